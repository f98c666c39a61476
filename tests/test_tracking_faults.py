"""Tracking never stops training (issue 30 item 8): a node whose Trackio database cannot be opened, written or copied
warns once, turns its tracking off, and keeps taking part in the collectives (train/tracking.py)."""

import os
import sqlite3
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


class Broken:
    calls = 0

    @classmethod
    def bulk_log(cls, *args, **kwargs):
        cls.calls += 1
        raise sqlite3.DatabaseError("database disk image is malformed")


def test_a_corrupt_live_database_turns_tracking_off_with_one_warning(tmp_path, capsys):
    from orchestrator.train.tracking import NodeTracker

    tracker = NodeTracker("p", "r-1", node=0, nodes=1, local_main=True, env={"ORCH_HOME": str(tmp_path)})
    tracker.storage = Broken
    for step in (1, 2, 3):
        tracker.log(step, {"step": step, "loss": 1.0}, tokens=10 * step, dist=None, now=float(step))
    out = capsys.readouterr().out
    assert out.count("[orch] warning: tracking off on node 0") == 1 and "database disk image is malformed" in out
    assert Broken.calls == 1 and "writing step 1" in tracker.off
    (tmp_path / "trackio" / "r-1").mkdir(parents=True)
    (tmp_path / "trackio" / "r-1" / "p.db").write_bytes(b"not a database")
    tracker.copy_to(tmp_path / "out")  # off: nothing copied, nothing raised
    assert not (tmp_path / "out").exists()


OPEN = """
import sys
from pathlib import Path
from orchestrator.train.tracking import NodeTracker
from orchestrator.core.trackio_files import node_copy
home, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
copy = node_copy(ckpt, 0, "p")
copy.parent.mkdir(parents=True)
copy.write_bytes(b"SQLite format 3\\x00" + b"\\xff" * 4000)  # a truncated, corrupt copy in the checkpoint
tracker = NodeTracker("p", "r-1", node=0, nodes=1, local_main=True, env={"ORCH_HOME": str(home)})
tracker.start(ckpt.parent, ckpt)
tracker.log(1, {"step": 1, "loss": 1.0}, tokens=10, dist=None, now=1.0)
print("trained on:", tracker.off)
"""


@pytest.mark.e2e  # not unit or cli: a process of its own that imports Trackio and torch (6-7.5 s, test-fast's slowest)
def test_a_corrupt_database_in_the_resumed_checkpoint_does_not_stop_the_run(tmp_path):
    """Trackio reads TRACKIO_DIR once, at import: a process of its own."""
    env = {**os.environ, "ORCH_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", OPEN, str(tmp_path / "home"), str(tmp_path / "out" / "checkpoint-4")],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stdout.count("[orch] warning: tracking off on node 0") == 1, done.stdout
    assert "trained on: " in done.stdout
