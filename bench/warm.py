"""`make bench` (f2): a new node's ranks, with and without the setup's bytecode warm-up (orchestrator/node/warm.py).

A new cloud node's environment holds the image's torch compiled and uv.lock's packages not (uv writes no bytecode).
Each run here gives Python a fresh PYTHONPYCACHEPREFIX with only torch's bytecode copied in, so every process sees
this environment as such a node; `orch run phi3_dpo_fsdp --local --nodes 2 --smoke` then reports its own launch and
model load (its time-to-first-step line). Warmed: node 1's `orch node --rehearse` ran first on that prefix, as the
setup runs it. Cold and warmed runs alternate.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from new_node import new_node_prefix, worker_env  # noqa: E402

ORCH = [sys.executable, "-m", "orchestrator"]


def launch_and_load(project: Path, prefix: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([*ORCH, "run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke", "--fresh", "-y",
                           "max_steps=1"], cwd=project, env={**env, "PYTHONPYCACHEPREFIX": str(prefix)},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    found = re.search(r"^\[orch\] time to first step: .* launch and model load ([\d.]+)", done.stdout, re.M)
    if done.returncode != 0 or not found:
        raise SystemExit(f"bench (f2): the run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(found.group(1))


def warm_up(prefix: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([*ORCH, "node", "--rehearse", "--warm"], cwd=ROOT, env=worker_env(prefix),
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0 or "warmed the dpo training stack" not in done.stdout:
        raise SystemExit(f"bench (f2): the warm-up did not run:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - started


def rows(project: Path, runs: int) -> list[tuple[str, float, int, str, str]]:
    root = Path(tempfile.mkdtemp(prefix="orch-bench-warm-"))
    cold, warmed, setup = [], [], []
    try:
        for _ in range(runs):
            cold.append(launch_and_load(project, new_node_prefix(Path(tempfile.mkdtemp(dir=root)))))
            prefix = new_node_prefix(Path(tempfile.mkdtemp(dir=root)))
            setup.append(warm_up(prefix))
            warmed.append(launch_and_load(project, prefix))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c, w, s = statistics.median(cold), statistics.median(warmed), statistics.median(setup)
    return [
        ("a new node's ranks: launch and model load, uv.lock's packages not compiled (reference)", c, 0, "", ""),
        ("the same after the setup's bytecode warm-up (node 1's orch node --rehearse)", w, 0,
         f"{c - w:.1f} s less per new node; the warm-up itself {s:.1f} s in the setup, beside the head's rehearsal "
         "and the download", ""),
    ]  # fmt: skip
