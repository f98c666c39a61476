"""Where every rank waits: each rank's Python stack by py-spy (a well-kept tool made for this: it reads a process's
memory, so it dumps a stopped or hung rank without its help), else by the rank's own faulthandler (SIGUSR1; not
for a stopped process), then one line per rank and the rank that is not where the others are.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

from orchestrator.node.procs import stat_fields

_FRAME = re.compile(r"^\s+(\S+) \((.+?)(?::(\d+))?\)\s*$")
STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "D": "in uninterruptible I/O (D state)"}


TRANSPARENT = ("orchestrator/train/stragglers.py",)
"""orch's own wrappers around torch's calls (the timed `Work.wait`): a stack is placed at the frame that called them."""


@dataclass
class RankStack:
    rank: int
    pid: int
    step: int
    state: str  # "" when running or sleeping; a STATES value otherwise; "gone" when the process ended
    frames: list[tuple[str, str]]  # (function, file:line) of the main thread, innermost first
    text: str  # the whole dump
    tool: str

    @property
    def collective(self) -> bool:
        return any("torch/distributed" in where for _, where in self.frames)

    def where(self) -> str:
        if not self.frames:
            return "no stack (the dump failed)"
        shown = [f for f in self.frames if not f[1].startswith(TRANSPARENT)] or self.frames
        function, location = shown[0]
        return f"in {function} ({location})"

    def line(self) -> str:
        return f"rank {self.rank}: {self.state + ' ' if self.state else ''}{self.where()}, step {self.step}"


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/", "/orchestrator/"):
        if marker in path:
            return ("orchestrator/" if marker == "/orchestrator/" else "") + path.split(marker, 1)[1]
    return path


def parse_py_spy(text: str) -> list[tuple[str, str]]:
    """The main thread's frames from `py-spy dump` output, innermost first."""
    frames: list[tuple[str, str]] = []
    in_main = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            if in_main:
                break
            in_main = '"MainThread"' in line
            continue
        match = _FRAME.match(line) if in_main else None
        if match:
            function, path, lineno = match.groups()
            frames.append((function, f"{_short(path)}:{lineno}" if lineno else _short(path)))
    return frames


def parse_faulthandler(text: str) -> list[tuple[str, str]]:
    """faulthandler's `File "x", line N in f` lines of the current (main) thread, innermost first."""
    blocks = text.strip().split("\n\n")
    main = next((b for b in blocks if "Current thread" in b), blocks[-1] if blocks else "")
    frames = []
    for line in main.splitlines():
        match = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if match:
            frames.append((match.group(3), f"{_short(match.group(1))}:{match.group(2)}"))
    return frames


def process_state(pid: int) -> str:
    fields = stat_fields(pid)
    if fields is None:
        return "gone"
    return STATES.get(fields[0], "gone" if fields[0] in "ZX" else "")


def py_spy() -> str:
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable)) or ""


def dump(rank: int, pid: int, step: int, progress_dir: str) -> RankStack:
    state = process_state(pid)
    tool = py_spy()
    if tool:
        try:
            # --nonblocking: read the memory without pausing the rank (a stopped rank cannot be paused again)
            out = subprocess.run(
                [tool, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.strip():
                return RankStack(rank, pid, step, state, parse_py_spy(out.stdout), out.stdout, "py-spy")
        except (subprocess.TimeoutExpired, OSError):
            pass
    if state == "stopped (SIGSTOP)":
        return RankStack(rank, pid, step, state, [], "py-spy could not read it; faulthandler cannot dump a stopped "
                         "process", "none")  # fmt: skip
    path = os.path.join(progress_dir, f"rank{rank}.stack")
    try:
        os.kill(pid, signal.SIGUSR1)  # train/progress.py registered faulthandler on it
        time.sleep(2)
        with open(path) as fh:
            text = fh.read()
    except OSError:
        text = ""
    return RankStack(rank, pid, step, state, parse_faulthandler(text), text, "faulthandler")


def odd_ones(stacks: list[RankStack]) -> list[RankStack]:
    """The ranks not where the others are: stopped or gone ones; else those outside a collective while others wait
    in one; else the minority place; else the ranks behind on steps. [] when every rank is at the same place."""
    if len(stacks) < 2:
        return [s for s in stacks if s.state]
    flagged = [s for s in stacks if s.state]
    if flagged and len(flagged) < len(stacks):
        return flagged
    outside = [s for s in stacks if not s.collective]
    if outside and len(outside) < len(stacks):
        return outside
    places = Counter(s.where() for s in stacks)
    if len(places) > 1:
        common, _ = places.most_common(1)[0]
        minority = [s for s in stacks if s.where() != common]
        if len(minority) < len(stacks) - len(minority):
            return minority
    behind = min(s.step for s in stacks)
    if any(s.step != behind for s in stacks):
        return [s for s in stacks if s.step == behind]
    return []
