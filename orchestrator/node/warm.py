"""A node's training stack compiled during its setup, not by its ranks after the launch (`orch node --rehearse --warm`,
which scripts/node-setup.sh passes when its setup installed the environment).

uv installs without compiling bytecode, so on a new node the first import of TRL and its stack compiles it: on the
head node the rehearsal does, during the setup; on the others their ranks did, after the launch, and every rank
waited for the slowest node at its first collective (2 cores: launch and model load 8.9 s cold, 5.5 s warm; 12.7 s
with torch cold too). Here every node but the head (and the head where no rehearsal imported the stack: a cached one,
or ORCH_REHEARSAL=off) imports it once, beside the head's rehearsal and its own download, in a process of its own
(orchestrator/train/warm.py: the node room imports no training stack). A few sentinel files say whether the bytecode
is there, so a reused cluster pays nothing. `uv pip install --compile-bytecode` would compile every installed module
instead (104 s for TRL, transformers, accelerate, peft, datasets and DeepSpeed on 2 cores, ~4,100 files, against
~9 s for the ~1,000 a rank imports).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# Modules every rank imports (the packages' own files): where their bytecode is there, the stack was imported here
SENTINELS = ("torch/__init__.py", "transformers/__init__.py", "transformers/trainer.py", "accelerate/__init__.py",
             "trl/__init__.py", "trl/scripts/{trainer}.py")  # fmt: skip


def _writable(path: Path) -> bool:
    """Can this process create `path` (a __pycache__ directory or a file in it)?"""
    for parent in (path, *path.parents):
        if parent.exists():
            return os.access(parent, os.W_OK)
    return False


def cold(trainer: str) -> tuple[list[str], list[str]]:
    """(the sentinel modules whose bytecode this environment lacks and could keep, those it cannot keep: read-only
    site-packages such as an image's system torch, which every process compiles again). Imports nothing."""
    missing: list[str] = []
    read_only: list[str] = []
    for rel in SENTINELS:
        top, _, inner = rel.partition("/")
        spec = importlib.util.find_spec(top)  # a top-level package: found, not imported
        if spec is None or not spec.submodule_search_locations:
            continue  # not installed: the rehearsal and the ranks say so
        source = Path(next(iter(spec.submodule_search_locations))) / inner.format(trainer=trainer)
        if not source.is_file():
            continue
        cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.exists():
            (missing if _writable(cached) else read_only).append(f"{top}/{inner.format(trainer=trainer)}")
    return missing, read_only


def stack(env: Mapping[str, str], trainer: str) -> str | None:
    """Warm this environment's bytecode for `trainer`'s training processes where it lacks it; the line saying what
    was done, or None where there was nothing to do. Never fails the setup: the ranks import the same modules, and
    any error is theirs to report."""
    from orchestrator.core import trainers

    if trainer not in trainers.SPECS:
        return None  # the head's rehearsal refuses it
    missing, read_only = cold(trainer)
    if not missing:
        if read_only:
            return f"bytecode not warmed: {read_only[0]}'s directory is read-only, so every process compiles it"
        return None
    if sys.flags.dont_write_bytecode:
        return "bytecode not warmed: PYTHONDONTWRITEBYTECODE is set, so every process on this node compiles it"
    # its own process group: whatever it started goes with it when this process is stopped (Ctrl-C, SIGTERM: the
    # setup stopping because the download failed)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.train.warm", trainer], env=dict(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    with contextlib.suppress(ProcessLookupError):  # nothing it started outlives it
        os.killpg(proc.pid, signal.SIGKILL)
    done = [line.split()[1:] for line in out.splitlines() if line.startswith("ORCH_WARM ")]
    if proc.returncode != 0 or not done:
        last = (err.strip() or out.strip() or "no output").splitlines()[-1]
        return f"bytecode not warmed ({trainer} stack's import failed: {last}); the ranks will meet the same error"
    modules, seconds = done[-1]
    return (f"warmed the {trainer} training stack's bytecode ({modules} modules, {float(seconds):.1f} s): this node's "
            "ranks start without compiling it")  # fmt: skip
