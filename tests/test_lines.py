"""core/lines.py: two processes printing to one pipe under PYTHONUNBUFFERED=1 (as a node's ranks do) keep their lines
whole with `whole_lines()`, and break them without it (the test of the test)."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

LINES = 20000  # per writer: long enough that the two overlap even when the suite's load delays one of them (at
# 3000 one writer could finish before the other started, and the unprotected case showed no broken line)
WRITER = """
import os, sys, time
from orchestrator.core.lines import whole_lines
if sys.argv[1] == "on":
    whole_lines()
while not os.path.exists(sys.argv[2]):  # both start writing together
    time.sleep(0.001)
for i in range(int(sys.argv[3])):
    print(f"{os.getpid()} line {i} " + "x" * 60, flush=True)
"""


def broken_lines(mode: str, go) -> int:
    read, write = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-c", WRITER, mode, str(go), str(LINES)]
    procs = [subprocess.Popen(argv, stdout=write, env=env) for _ in range(2)]
    os.close(write)
    time.sleep(0.5)
    go.touch()
    with os.fdopen(read) as fh:
        text = fh.read()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = text.splitlines()
    assert len(lines) <= 2 * LINES
    return sum(not (line.count(" line ") == 1 and line.endswith("x" * 60)) for line in lines) + 2 * LINES - len(lines)


def test_each_line_is_one_write(tmp_path):
    assert broken_lines("on", tmp_path / "go-on") == 0
    assert broken_lines("off", tmp_path / "go-off") > 0  # what the ranks' output was: interleaved mid-line
