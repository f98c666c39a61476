"""Scaling efficiency against a single-node rate measured earlier (issue 32, item 2).

On a good network 2 nodes keep about 95% of one node's per-GPU throughput, so a multi-node run's tokens/s per rank
against what one node of the same setup did says whether the extra nodes pay. Rank 0 keeps the rates in
`CHECKPOINT_ROOT/orch_rates.json`, next to every run of the recipe (a cloud's bucket is per recipe and user, so the
record outlives clusters and runs; locally `outputs/`), keyed by the training settings (schedule left out), the
per-device batch and the accelerator's name. A single-node run records its rate per rank; a multi-node run with a
recorded rate prints its efficiency at the end, and its report keeps it (the summary repeats it). No CHECKPOINT_ROOT
(an output_dir of the user's choosing): nothing is recorded or compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

FILE = "orch_rates.json"
SCHEDULE = ("max_steps", "num_train_epochs")


def key(run_config: dict, per_device: int, device: str) -> str:
    """What makes two runs' per-rank rates comparable: the same training settings, batch per device, processes per
    node (2 x 8 is compared with 1 x 8) and accelerator."""
    settings = {k: v for k, v in (run_config.get("settings") or {}).items() if k not in SCHEDULE}
    digest = hashlib.sha256(json.dumps([run_config.get("trainer"), settings], sort_keys=True, default=str).encode())
    per_node = (run_config.get("shape") or {}).get("per_node", 1)
    return f"{digest.hexdigest()[:16]}|{per_device}|{per_node}|{device}"


def _path() -> Path | None:
    root = os.environ.get("CHECKPOINT_ROOT", "").strip()
    return Path(root) / FILE if root else None


def _read(path: Path) -> dict:
    try:
        rates = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return rates if isinstance(rates, dict) else {}


def compare_or_record(key_: str, per_rank: float, shape: dict, run: str) -> dict | None:
    """Rank 0 at the end: a single-node run records its tokens/s per rank; a multi-node run gets its efficiency
    against the recorded one ({"efficiency", "single_node", "per_rank", "shape"}), None when there is none."""
    path = _path()
    if path is None or per_rank <= 0:
        return None
    rates = _read(path)
    if shape.get("nodes", 1) <= 1:
        rates[key_] = {"per_rank_tokens_per_s": round(per_rank, 3), "shape": shape, "run": run,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return None
    single = rates.get(key_)
    if not isinstance(single, dict) or not single.get("per_rank_tokens_per_s"):
        return None
    return {"efficiency": per_rank / float(single["per_rank_tokens_per_s"]), "single_node": single,
            "per_rank": per_rank, "shape": shape}  # fmt: skip


def line(found: dict) -> str:
    single, shape = found["single_node"], found["shape"]
    was = single.get("shape") or {}
    return (f"[orch] scaling efficiency: {100 * found['efficiency']:.0f}% of the single-node rate per rank "
            f"({found['per_rank']:,.0f} tok/s per rank on {shape['nodes']} x {shape['per_node']}; "
            f"{single['per_rank_tokens_per_s']:,.0f} on {was.get('nodes', 1)} x {was.get('per_node', '?')} by run "
            f"{single.get('run', '?')}, {single.get('time', '?')})")
