"""A node's own directory for orch (ORCH_HOME, default ~/.orch), shared by the node launcher and the training
processes: setup timings, NCCL traces, Trackio's live databases, and the checkpoint request of the preemption hook."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# `orch node --checkpoint-now` writes the request; the ranks (train/callbacks.py) save and write the done file
SAVE_REQUEST, SAVE_DONE = "checkpoint-request", "checkpoint-done"


def orch_home(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("ORCH_HOME") or Path.home() / ".orch")
