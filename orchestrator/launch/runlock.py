"""One owner per run directory: an flock on sky_jobs/.locks/<hash of the output dir>.lock.

The lock is the kernel's: it is released when the last process holding the open file ends, however it ends
(SIGKILL included), so there is no stale lock file to clean up. orch takes it before it writes anything for a local
run and passes it to each node's guard, so it is held until the last node is gone: a second `orch run` of the same
run is refused while any of it lives, and `orch status` can tell a live run from one whose orch was killed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from orchestrator.core.errors import OrchError

LOCKS = Path("sky_jobs") / ".locks"


def key(output_dir: str | Path) -> str:
    """The output directory's identity, its resolved path hashed: one lock, and one local run's node directory
    (launch/backends/local_nodes.py), per output directory."""
    return hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]


def path_for(output_dir: str | Path) -> Path:
    return LOCKS / f"{key(output_dir)}.lock"


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def acquire(run: str, output_dir: str | Path, command: str) -> int:
    """Take the run's lock and return its file descriptor (inheritable, to pass to the nodes' guards). Raises
    OrchError naming the live owner (pid, start, how to stop it) when another orch holds it."""
    path = path_for(output_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        reason = f"{exc.strerror}; run orch from a writable directory"
        raise OrchError(f"cannot create the run lock {path}: {reason}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _holder(path)
        pid = holder.get("pid", "?")
        raise OrchError(
            f"run {run} is already running (orch pid {pid}, started {holder.get('started', '?')}, output "
            f"{output_dir}): wait for it, follow it with `orch logs {run}`, or stop it with `kill {pid}`"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "run": run, "started": time.strftime("%H:%M:%S"),
                             "command": command}).encode())  # fmt: skip
    return fd


def held(output_dir: str | Path) -> bool:
    """Whether some live process (an orch or one of its nodes' guards) holds the run's lock."""
    path = path_for(output_dir)
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def reap(token: str) -> list[int]:
    """Kill what is left of a run whose orch and guards are gone: processes whose environment carries its launch
    token (every process of a local run inherits ORCH_RUN_TOKEN). Returns their pids."""
    import signal

    needle = f"ORCH_RUN_TOKEN={token}".encode()
    found = []
    for entry in os.listdir("/proc") if token and os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
            found.append(int(entry))
        except (OSError, ProcessLookupError):
            continue
    return found
