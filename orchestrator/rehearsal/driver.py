"""Rehearse a launch's rank roles against the owners' code (driver; imports nothing heavy).

A launch of N nodes has at most three distinct roles: the head (node 0), any other trainer node (all alike but
for their rank), and the vLLM server node. Each is rehearsed in a subprocess (`orchestrator.rehearsal.role`)
that needs the training stack installed; see that module for what runs. The recipe's model and data are
replaced by the tiny smoke model and data of the same family and trainer (built locally, cached), and what
needs a GPU or the network is swapped for what runs here; every swap is listed in the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.node.plan import NodePlan

PORTABLE_ATTENTION = ("sdpa", "eager")


class Outcome(NamedTuple):
    role: str
    ok: bool
    facts: dict
    stage: str = ""
    error: str = ""


def roles(plans: list[NodePlan]) -> list[tuple[str, NodePlan]]:
    """The distinct roles of a launch: the head, one other trainer node, the vLLM server node."""
    trainers = [p for p in plans if p.role == "trainer"]
    out = [("head (node 0)", trainers[0])]
    if len(trainers) > 1:
        out.append((f"trainer node {trainers[1].topology.node_rank} of {len(trainers)}", trainers[1]))
    out += [(f"vLLM server (node {len(plans) - 1})", p) for p in plans if p.role == "vllm-server"]
    return out


def substitutions(trainer: str, settings: Mapping[str, object], smoke_dir: Path, output_dir: str) -> list[str]:
    """TRL script arguments appended after orch's (later flags win) so the trainer builds here without GPU or
    network: the tiny model and data of the recipe's family, portable attention, no vLLM engine, no tracker."""
    words = [
        "--model_name_or_path", str(smoke_dir / "model"),
        "--dataset_name", str(smoke_dir / "data"),
        "--dataset_train_split", "train",
        "--output_dir", output_dir,
        "--report_to", "none",
    ]  # fmt: skip
    if str(settings.get("attn_implementation") or "sdpa") not in PORTABLE_ATTENTION:
        words += ["--attn_implementation", "sdpa"]
    if str(settings.get("use_liger_kernel", "false")).lower() == "true" and not _importable("liger_kernel"):
        words += ["--use_liger_kernel", "false"]
    if trainer == "grpo" and str(settings.get("use_vllm", "false")).lower() == "true":
        words += ["--use_vllm", "false"]
    return words


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class Role(NamedTuple):
    """What one node runs: the argv it execs, the variables it sets first, trainer or vllm-server."""

    name: str
    argv: list[str]
    env: dict[str, str] = {}
    role: str = "trainer"


PROCESS_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    # DeepSpeed picks its accelerator from torch.cuda, which the rehearsal fakes: keep its tensors on CPU
    # (TRL initializes DPO/KTO reference models with deepspeed.initialize in the trainer's constructor).
    "DS_ACCELERATOR": "cpu",
}


def rehearse_roles(
    trainer: str, roles_: list[Role], substitute: list[str], devices: int, workdir: Path = Path(".")
) -> list[Outcome]:
    """The roles of one launch in one subprocess (the training stack is imported once; each role forks).

    devices: GPUs per node to report (0 for a CPU launch)."""
    batch = {
        "trainer": trainer,
        "devices": devices,
        "process_env": PROCESS_ENV,
        "roles": [{"argv": list(r.argv), "env": dict(r.env), "role": r.role, "substitute": substitute} for r in roles_],
    }
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.rehearsal.role"],
        input=json.dumps(batch),
        cwd=workdir,
        env={**os.environ, **PROCESS_ENV},
        capture_output=True,
        text=True,
    )
    lines = [x.split(" ", 1)[1] for x in result.stdout.splitlines() if x.startswith("ORCH_REHEARSAL ")]
    outcomes = []
    for i, r in enumerate(roles_):
        if i >= len(lines):
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            why = f"the rehearsal process failed (exit {result.returncode}): {tail[0]}"
            outcomes.append(Outcome(r.name, False, {}, "rehearsal", why))
            continue
        data = json.loads(lines[i])
        outcomes.append(
            Outcome(r.name, data["ok"], data.get("facts", {}), data.get("stage", ""), data.get("error", ""))
        )
    return outcomes


def rehearse(
    plans: list[NodePlan], trainer: str, settings: Mapping[str, object], smoke_dir: Path, workdir: Path = Path(".")
) -> list[Outcome]:
    """Every distinct role of a launch; `settings` are the TRL settings the node would use (config + overrides)."""
    selected = [Role(name, p.argv, p.env, p.role) for name, p in roles(plans)]
    devices = 0 if "--use_cpu" in plans[0].argv else plans[0].topology.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="orch-rehearsal-out-") as out:
        substitute = substitutions(trainer, settings, smoke_dir, out)
        return rehearse_roles(trainer, selected, substitute, devices, workdir)
