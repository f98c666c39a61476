"""A process tree's keeper, shared by the local backend's guard and the node launcher (`orch node`): become a child
subreaper (torchrun starts every rank in a session of its own, so a process-group signal misses them, but an
orphaned rank is re-parented to the subreaper, never to init), list every descendant from /proc, end them all."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

PR_SET_CHILD_SUBREAPER = 36
DEFAULT_GRACE = 10.0  # ORCH_STOP_GRACE: seconds between SIGTERM and SIGKILL when a tree is ended


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after "pid (comm) ": state, ppid, ... (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the process-group signal is all there is
        pass


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc (ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if fields is None or fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def reap(child: subprocess.Popen | None = None) -> None:
    """Collect exited descendants (orphans re-parented here), keeping CMD's own exit status for Popen."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if child is not None and pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)


def end_tree(grace: float, child: subprocess.Popen | None = None) -> None:
    """SIGTERM to every descendant, then SIGKILL to whatever is left after `grace` seconds."""
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            reap(child)
            if not descendants(me):
                return
            time.sleep(0.1)


def stopped_group(pid: int) -> str:
    """', which is stopped (SIGSTOP or a debugger) in its process group' when a process of that group is, else ''."""
    try:
        pgid = os.getpgid(pid)
    except OSError:
        return ""
    for entry in os.listdir("/proc"):
        fields = stat_fields(entry) if entry.isdigit() else None
        if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and fields[0] in ("T", "t"):
            return ", which is stopped (SIGSTOP, or a debugger)"
    return ""
