"""`python -m orchestrator.train <trainer> --config FILE [...]`: what `accelerate launch --module` runs on a node."""

import os

from orchestrator.core import bnb
from orchestrator.core.knobs import knob

if knob(os.environ, bnb.ENV, "on") == "off":  # a smoke run that uses none: as its nodes run (core/bnb.py)
    bnb.hide()

from orchestrator.train.entry import run  # noqa: E402

run()
