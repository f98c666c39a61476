"""The training process's side of the node watchdog (orchestrator/node/watchdog.py).

Each rank keeps one small JSON file in ORCH_PROGRESS_DIR (set by `orch node`), rewritten atomically:
  - at every optimizer step (the step number and the time);
  - every HEARTBEAT seconds while it saves a checkpoint, evaluates or writes the final model: those take minutes on
    a large model and have no callback before they start, so a heartbeat thread vouches for them (the watchdog
    credits heartbeats for ORCH_STALL_BUSY seconds at most: a collective that hangs inside a save is still found).
A rank that hangs in a collective, or is stopped, writes nothing more, and the node launcher notices.

At start each rank also lets its node launcher read its stack: prctl(PR_SET_PTRACER) where Yama restricts ptrace
to ancestors (py-spy attaches from the node launcher, which may not be the rank's direct parent), and faulthandler
on SIGUSR1 as a fallback for when py-spy is missing (faulthandler cannot dump a stopped process; py-spy can).

Standard library only: no cost when the directory is not set (the rehearsal, a hand-started rank).
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import threading
import time
from collections.abc import Mapping

PR_SET_PTRACER = 0x59616D61
HEARTBEAT = 2.0
BUSY_PHASES = ("save", "eval", "final")


class Progress:
    def __init__(self, directory: str, rank: int, launcher_pid: int = 0):
        self.path = os.path.join(directory, f"rank{rank}.json")
        self.rank = rank
        self.step = 0
        self.phase = "load"
        self.output_dir = ""
        self._lock = threading.Lock()
        if launcher_pid:
            try:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, launcher_pid, 0, 0, 0)
            except (OSError, AttributeError):
                pass
        self._stacks = open(os.path.join(directory, f"rank{rank}.stack"), "w")  # noqa: SIM115 (lives with the process)
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self._write()
        threading.Thread(target=self._heartbeat, name="orch-heartbeat", daemon=True).start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Progress | None:
        directory = env.get("ORCH_PROGRESS_DIR", "")
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, int(env.get("RANK", "0")), int(env.get("ORCH_NODE_PID", "0") or 0))

    def _write(self) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "t": time.time(),
            "output_dir": self.output_dir,
        }
        with self._lock:
            tmp = f"{self.path}.tmp"
            try:
                with open(tmp, "w") as fh:
                    fh.write(json.dumps(record))
                os.replace(tmp, self.path)
            except OSError:  # the launcher's directory is gone (it is ending the node): nothing to report to
                pass

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT)
            if self.phase in BUSY_PHASES:
                self._write()

    def stepped(self, step: int, busy: str = "") -> None:
        """An optimizer step finished; `busy` names what comes next without a callback before it (save, eval)."""
        self.step = step
        self.phase = busy or "train"
        self._write()

    def busy(self, phase: str) -> None:
        self.phase = phase
        self._write()

    def idle(self) -> None:
        """Back to training after a save or an evaluation."""
        self.busy("train")
