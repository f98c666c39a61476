"""`python -m orchestrator.train <trainer> --config FILE [...]`: what `accelerate launch --module` runs on a node."""

from orchestrator.train.entry import run

run()
