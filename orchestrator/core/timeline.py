"""Time to first step: when each stage of a run's start ended, as the node setup, `orch node` and the training
process record it (epoch seconds), and the one-line breakdown users read.

Keys: launched (when `orch run` sent the task: ORCH_LAUNCHED_AT, from the local backend or, on a cloud, at the SkyPilot
submission), setup_started, setup_installed, setup_rehearsed, setup_warmed, setup_prefetched, setup_done
(scripts/node-setup.sh: the rehearsal, then any bytecode warm-up, and the download start when the install ends and run
at once), node_started, barrier_passed (`orch
node`), model_loaded, first_step (the training process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def time_to_first_step(timeline: dict[str, float]) -> str:
    """`52.3 s = setup 30.1 (install 20.0, rehearsal 8.0 alongside download 10.1) + waiting for the other nodes 3.2
    + ...`, from the timestamps the node setup, `orch node` and the training process recorded (what is unknown is left
    out)."""
    t = dict(timeline)
    parts = []
    if "launched" in t and "setup_started" in t:
        if t["setup_started"] >= t["launched"]:  # SkyPilot: one request provisions, installs its runtime, queues a job
            parts.append(f"SkyPilot's provisioning, runtime and job start {t['setup_started'] - t['launched']:.1f}")
        else:  # the laptop's clock ahead of the node's: no figure rather than a wrong one
            del t["launched"]
    if "setup_started" in t and "setup_done" in t:
        steps = []
        if "setup_installed" in t:
            steps.append(f"install {t['setup_installed'] - t['setup_started']:.1f}")
            beside = [f"{name} {t[f'setup_{key}'] - t['setup_installed']:.1f}"
                      for key, name in (("rehearsed", "rehearsal"), ("prefetched", "download")) if f"setup_{key}" in t]
            if "setup_rehearsed" in t and "setup_warmed" in t and beside:  # the warm-up follows in the same process
                beside[0] += f" then bytecode warm-up {t['setup_warmed'] - t['setup_rehearsed']:.1f}"
            if beside:  # both start when the install ends and run at once
                steps.append(" alongside ".join(beside))
        parts.append(f"setup {t['setup_done'] - t['setup_started']:.1f}" + (f" ({', '.join(steps)})" if steps else ""))
    before_node = t.get("setup_done", t.get("launched"))
    if before_node is not None and "node_started" in t:
        what = "from setup to orch node" if "setup_done" in t else "starting the node"
        parts.append(f"{what} {t['node_started'] - before_node:.1f}")
    if "node_started" in t and "barrier_passed" in t:
        parts.append(f"waiting for the other nodes {t['barrier_passed'] - t['node_started']:.1f}")
    if "barrier_passed" in t and "model_loaded" in t:
        parts.append(f"launch and model load {t['model_loaded'] - t['barrier_passed']:.1f}")
    if "model_loaded" in t and "first_step" in t:
        parts.append(f"first step {t['first_step'] - t['model_loaded']:.1f}")
    start = min((t[k] for k in ("setup_started", "launched", "node_started") if k in t), default=None)
    total = f"{t['first_step'] - start:.1f} s" if start is not None and "first_step" in t else "?"
    return f"{total} = " + " + ".join(parts) + " (seconds)"


def setup_times_file(env: Mapping[str, str], home: str | os.PathLike) -> str | None:
    """This node's timings file of scripts/node-setup.sh (which names it the same way): one per node of each cluster,
    since on Slurm every node of every cluster of the account shares the home. SkyPilot's setup names the node
    SKYPILOT_SETUP_NODE_RANK, its run SKYPILOT_NODE_RANK; SKYPILOT_CLUSTER_INFO is the same text in both. None
    for a rank that is not a number (the setup refuses it; no path is made of it)."""
    import hashlib

    rank = env.get("SKYPILOT_SETUP_NODE_RANK") or env.get("SKYPILOT_NODE_RANK") or "0"
    if not (rank.isascii() and rank.isdigit()):
        return None
    cluster = hashlib.sha256(env.get("SKYPILOT_CLUSTER_INFO", "").encode()).hexdigest()[:12]
    return os.path.join(home, f"setup-{cluster}-node{rank}.times")


def record(path: str | None, key: str, value: str | None = None) -> None:
    """Append `key=value` (default: now, in epoch seconds) to a setup timings file, if one is named. The rehearsal and
    the download run at once in scripts/node-setup.sh, so each records its own end, or its error line (`error=`),
    which the setup prints last."""
    if path:
        import time

        with open(path, "a") as fh:
            fh.write(f"{key}={value if value is not None else f'{time.time():.3f}'}\n")


def duration(seconds: float) -> str:
    """2h05m, or 4m07s under an hour (ETA and elapsed time in step lines, `orch status`)."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
