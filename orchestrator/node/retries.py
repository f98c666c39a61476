"""A node that keeps failing the same retryable way stops asking to be retried.

A node exits 75 (retryable) for the cluster's failures: a stall its watchdog ended, a network, NCCL or GPU failure
(node/supervise.py). A managed job recovers on it (job_recovery.recover_on_exit_codes: [75]), and SkyPilot 0.14 does
not count such a recovery against max_restarts_on_errors (sky/jobs/recovery_strategy.py, should_restart_on_failure):
a failure that is the cluster's and also certain to come back (an NCCL setting wrong for this cluster, a hang the
watchdog ends at the same step every time) would relaunch until ORCH_MAX_COST stops it, or forever without a cap.

So each retryable exit is recorded next to the checkpoints (`<output_dir>/orch/retryable/node<N>-<ms>-<random>.json`:
when, and the last step a rank of this node reported, if any), and a node whose last ORCH_STUCK_RETRIES (3) retryable
exits each trained no step beyond the best of the ones before exits 1 instead, saying why. The three retryable exits
count: a failure the node's supervisor reads as the cluster's, a stall its watchdog ended (node/supervise.py) and a
barrier never passed (node/exec._barrier). Each node counts its own: a 75 only comes from a node that recorded it, so
the recoveries stop once each node that exits on its own has given up.

Only the exits of one launch count together: SkyPilot's recoveries of a managed job keep its SKYPILOT_TASK_ID
(sky/jobs/controller.py sets it once for the job), while a launch by hand (`orch run --resume`, `sky launch` again, a
local rerun: its own ORCH_RUN_TOKEN) gets a new one, and starts its own count: a person relaunching after a fix is
not stopped by the earlier launch's failures.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from orchestrator.core.knobs import knob

DEFAULT_LIMIT = 3


def give_up(output_dir: str, node: int, step: int | None, env: Mapping[str, str], now: float | None = None) -> str:
    """Record this retryable exit of `node` (its ranks' last reported step, None before any); the words saying why it
    exits 1 instead, or '' to exit 75. Nothing is recorded, and 75 stands, without an output dir or where it cannot be
    written."""
    limit = knob(env, "ORCH_STUCK_RETRIES", DEFAULT_LIMIT)
    if not output_dir:
        return ""
    where = Path(output_dir).expanduser() / "orch" / "retryable"  # ~/...: as TrainingArguments expands it
    now = time.time() if now is None else now
    launch = launch_of(env)
    try:
        where.mkdir(parents=True, exist_ok=True)
        name = f"node{node}-{int(now * 1000)}-{uuid.uuid4().hex[:8]}.json"  # two exits never share one
        (where / name).write_text(json.dumps({"time": now, "step": step, "launch": launch}))
    except OSError:
        return ""
    events = []
    for path in where.glob(f"node{node}-*.json"):
        try:
            record = json.loads(path.read_text())
            if record.get("launch", launch) == launch:  # a record from before launches were told apart: counted
                events.append((float(record["time"]), record.get("step")))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    best, stuck = -1, 0
    for _, reached in sorted(events):
        reached = reached if isinstance(reached, int) else -1
        best, stuck = (reached, 0) if reached > best else (best, stuck + 1)
    if stuck < limit:
        return ""
    where_words = f"beyond step {best}" if best >= 0 else "at all"
    times = "once" if stuck == 1 else f"{stuck} times in a row"
    return (f"node {node} failed the retryable way {times} without training a step {where_words}: not "
            f"retried again (SkyPilot's managed jobs recover on exit 75 without limit; ORCH_STUCK_RETRIES={limit} "
            f"allows more; its record: {where})")


def launch_of(env: Mapping[str, str]) -> str:
    """The launch a node's exit belongs to: SkyPilot's task id (kept by a managed job's recoveries, new for a launch by
    hand) and a local run's token (new at every `orch run --local`)."""
    return f"{env.get('SKYPILOT_TASK_ID', '')}|{env.get('ORCH_RUN_TOKEN', '')}"
