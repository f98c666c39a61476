"""Node side: the TRL script's part of the argv (`--module orchestrator.train <trainer> --config ... [--key value]`).

Order matters: the TRL config, then the recipe's key=value overrides, then what orch decides (output_dir under
CHECKPOINT_ROOT, the vLLM server's address, pad_to_multiple_of, ddp_timeout, the accumulation that keeps the
global batch, the CPU switches), so orch's values win where both are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.core import overrides
from orchestrator.core.errors import OrchError
from orchestrator.node.env import run_id

TRAIN_MODULE = "orchestrator.train"


def checkpoint_dir(root: str, task_id: str) -> str:
    """Where a run keeps its checkpoints and final model: one directory per task id under CHECKPOINT_ROOT."""
    return f"{root.rstrip('/')}/{task_id}"


def output_dir_in(argv: Sequence[str]) -> str:
    """The ranks' output dir as their argv gives it: its last --output_dir (TRL's parser lets a later flag win; orch's
    CHECKPOINT_ROOT/<run id> comes last), '' where there is none (the TRL config's then)."""
    given = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--output_dir"]
    return given[-1] if given else ""


def arguments(
    env: Mapping[str, str],
    trainer: str,
    trl_path: str,
    user: Mapping[str, str],
    *,
    decided: list[str],
    accumulation: int | None,
    device_args: tuple[str, ...] = (),
) -> list[str]:
    """decided: arguments orch computed for this node (vLLM server address, pad_to_multiple_of); device_args: what
    the launcher needs the TRL script to be told on this device (`--use_cpu true` or `--ddp_backend gloo` on CPU)."""
    extra = list(decided)
    root = env.get("CHECKPOINT_ROOT", "").strip()
    if root:  # run-keyed: a recovered managed job (same task id) finds its checkpoints
        task_id = run_id(env)
        if not task_id:
            raise OrchError(
                "CHECKPOINT_ROOT is set but no run id is: SkyPilot sets SKYPILOT_TASK_ID on every node (Slurm: the job "
                "id); elsewhere set ORCH_RUN_ID, the same on every node"
            )
        user = {k: v for k, v in user.items() if k != "output_dir"}
        extra += ["--output_dir", checkpoint_dir(root, task_id)]
    timeout = env.get("DDP_TIMEOUT", "").strip()
    if timeout:
        if not timeout.isdigit() or int(timeout) < 1:
            raise OrchError(f"DDP_TIMEOUT={timeout!r} must be a whole number of seconds")
        extra += ["--ddp_timeout", timeout]
    argv = ["--module", TRAIN_MODULE, trainer, "--config", trl_path, *overrides.to_argv(user, trainer), *extra]
    if accumulation is not None:
        argv += ["--gradient_accumulation_steps", str(accumulation)]
    return argv + list(device_args)
