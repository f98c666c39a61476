"""What a run has spent over all its attempts (issue 32, item 3), in one file next to its checkpoints.

A run can take several attempts: a managed job recovered after a preemption, a rerun after a crash, a resume on another
shape. Each attempt's own meter starts from zero (train/throughput.Meter), so the cost cap (--max-cost) and the summary
would forget the earlier ones. `<output_dir>/orch_spend.json` keeps one entry per attempt (its start, seconds so far,
$/h and dollars), rewritten atomically by the world's main process at every logging step; at the start of training the
main process reads the entries of the earlier attempts and every rank gets their sum. It lives where the checkpoints
do (CHECKPOINT_ROOT/<run>: the bucket on a cloud), so it outlives the cluster; --fresh deletes it with the rest.
Time between an attempt's last logging step and its end (a preemption) is not in it: at most one logging interval.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

FILE = "orch_spend.json"


def attempt_id(started: float) -> str:
    """This attempt's key: when its node started and where (two attempts never share both)."""
    return f"{started:.3f}-{socket.gethostname()}-{os.getpid()}"


def read(output_dir: Path) -> dict[str, dict]:
    """The attempts recorded so far ({} when there is no record or it cannot be read: a run from before the record)."""
    try:
        attempts = json.loads((output_dir / FILE).read_text()).get("attempts") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): v for k, v in attempts.items() if isinstance(v, dict)}


def earlier(output_dir: Path, attempt: str) -> tuple[float, float, int]:
    """(dollars, seconds, attempts) of the recorded attempts other than this one."""
    others = [v for k, v in read(output_dir).items() if k != attempt]
    dollars = sum(float(v.get("usd") or 0.0) for v in others)
    seconds = sum(float(v.get("seconds") or 0.0) for v in others)
    return dollars, seconds, len(others)


def write(output_dir: Path, attempt: str, started: float, seconds: float, price: float | None) -> None:
    """Record this attempt's spend so far (temp file + rename: a reader sees the old record or the new one)."""
    attempts = read(output_dir)
    attempts[attempt] = {"started": started, "seconds": round(seconds, 3), "price_per_hour": price,
                         "usd": None if price is None else round(price * seconds / 3600, 6)}  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".{FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"attempts": attempts}, indent=1, sort_keys=True))
    os.replace(tmp, output_dir / FILE)
