"""A rank that a signal ended: named, and when it was SIGKILL, whether the kernel's OOM killer sent it.

Such a rank writes no error and no traceback; torchrun's report of the first failure is the only place that names it
(torch/distributed/elastic/multiprocessing/errors/__init__.py, _FAILURE_FORMAT_TEMPLATE: `rank : R (local_rank: L)`,
then `traceback : Signal 9 (SIGKILL) received by PID P`), and the other ranks fail with the network error its loss
made them see, which alone reads as a retryable network failure. Host memory running out is the common cause on GPU
nodes (every rank loading a full copy of the model into RAM): the kernel's OOM killer sends SIGKILL and counts it in
/proc/vmstat `oom_kill` (memory cgroup OOM kills too: a Slurm job's --mem, a container's limit), which the node reads
when the launch starts and when it fails. Read by node/supervise.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)")
_SIGNAL = re.compile(r"traceback\s*:\s*Signal (\d+) \((SIG[A-Z0-9]+)\) received by PID (\d+)")
_BLOCK = 8  # lines of torchrun's failure block after its heading


class Killed(NamedTuple):
    rank: int
    signal: int
    name: str
    pid: int


class RootCause:
    """torchrun's report of the first failure, fed line by line: `killed` once it names a rank that a signal ended."""

    def __init__(self) -> None:
        self.killed: Killed | None = None
        self._left = 0
        self._rank: int | None = None

    def feed(self, line: str) -> None:
        text = line.strip()
        if self.killed:
            return
        if text.endswith(ROOT_CAUSE):
            self._left, self._rank = _BLOCK, None
        elif self._left:
            self._left -= 1
            if rank := _RANK.fullmatch(text):
                self._rank = int(rank.group(1))
            elif (signal := _SIGNAL.fullmatch(text)) and self._rank is not None:
                self.killed = Killed(self._rank, int(signal.group(1)), signal.group(2), int(signal.group(3)))


def oom_kills(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """The kernel's count of OOM kills on this machine since it booted (memory cgroups' included); None where the
    kernel does not say (before Linux 4.13, or no /proc)."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def cause(killed: Killed, node: int, step: int | None, oom_before: int | None, oom_now: int | None) -> str:
    """One line: which rank a signal ended, where, and why when the kernel says."""
    at = "" if step is None else " before its first step" if step == 0 else f" after step {step}"  # the last it said
    said = f"rank {killed.rank} (node {node}) was killed by {killed.name} (signal {killed.signal}){at}"
    if killed.name != "SIGKILL":
        if killed.name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE"):
            return f"{said}: a crash in native code (a kernel, NCCL, a C extension); the lines before it show where"
        return f"{said}: sent from outside the training"
    if oom_before is None or oom_now is None:
        return f"{said}: the kernel's OOM killer sends it when host memory runs out (this kernel does not count them)"
    if oom_now > oom_before:
        return (f"{said}: the kernel's OOM killer ({oom_now - oom_before} OOM kill(s) on this machine during the "
                "launch): host memory (RAM, not GPU memory) ran out; a node with more memory or fewer processes per "
                "node would fit")  # fmt: skip
    return f"{said}, not by the kernel's OOM killer (none on this machine during the launch): from outside the training"
