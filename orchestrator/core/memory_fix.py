"""Out of memory, the first GPU failure people hit: recognise it in a rank's first error and name the fix that keeps
the math (the same global batch): the per-device batch halved and the accumulation doubled.

Under GLOBAL_BATCH_SIZE the node computes the accumulation itself, so halving the per-device batch doubles it;
without one, orch doubles gradient_accumulation_steps explicitly. At a per-device batch of 1 nothing is left to
halve: the fix is a strategy that shards more (FSDP, ZeRO-3, offload) or shorter sequences.

Both sides name it: a local run (launch/backends/local_backend.py, with --auto-fit's retry) and every node whose rank
failed out of memory (node/supervise.py, `advice`), so a GPU cluster launched with plain `sky launch` gets it too.
Before launch the memory check names the largest smaller batch that fits instead (core/batch.smaller, core/fit.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# CUDA's allocator (torch.OutOfMemoryError / "CUDA out of memory"), ROCm/HIP's, the CPU allocator's, Python's.
OOM = re.compile(
    r"OutOfMemoryError|CUDA out of memory|HIP out of memory|CUDA error: out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|^MemoryError\b"
)
TRAINING_ARGUMENTS_DEFAULT_BATCH = 8  # transformers' TrainingArguments.per_device_train_batch_size


def is_oom(error: str) -> bool:
    return bool(error and OOM.search(error))


@dataclass
class Fix:
    batch: int
    accumulation: str
    overrides: dict[str, str] | None
    smaller: int = 0
    """The per-device batch proposed (a divisor of `batch`, so the accumulation grows by a whole factor)."""
    least: str = ""
    """Why no smaller batch is proposed above 1: the trainer's least per-device batch, in words."""

    def words(self) -> str:
        return " ".join(f"{k}={v}" for k, v in (self.overrides or {}).items())

    def describe(self) -> str:
        if self.overrides is None:
            return (
                f"the per-device batch is already {self.batch}{self.least}: shard more (FSDP2, ZeRO-3, CPU offload), "
                "enable gradient_checkpointing=true, or shorten max_length"
            )
        factor = self.batch // self.smaller
        how = ("halve the per-device batch", "double the accumulation") if factor == 2 else \
            ("cut the per-device batch", f"multiply the accumulation by {factor}")  # fmt: skip
        return (
            f"{how[0]} ({self.batch} -> {self.smaller}) and {how[1]} ({self.accumulation}): the same global batch, "
            "so the same math; or a strategy that shards more"
        )


def propose(settings: Mapping[str, object], envs: Mapping[str, str]) -> Fix:
    """The largest per-device batch at most half the current one that divides it (so the accumulation grows by a whole
    factor and the global batch stays exact) and that the trainer (envs' TRL_TRAINER) accepts."""
    from orchestrator.core import trainers

    batch = int(str(settings.get("per_device_train_batch_size") or TRAINING_ARGUMENTS_DEFAULT_BATCH))
    name = str(envs.get("TRL_TRAINER", ""))
    spec = trainers.SPECS.get(name)
    least = spec.min_micro_batch if spec else 1
    smaller = max((d for d in range(least, batch // 2 + 1) if batch % d == 0), default=0)
    if not smaller:
        why = f", the least {name.upper()} takes ({spec.min_micro_batch_why})" if spec and least > 1 else ""
        return Fix(batch, "", None, least=why)
    factor = batch // smaller
    overrides = {"per_device_train_batch_size": str(smaller)}
    if str(envs.get("GLOBAL_BATCH_SIZE", "")).strip():
        accumulation = f"GLOBAL_BATCH_SIZE={envs['GLOBAL_BATCH_SIZE']} is kept: orch computes it on the nodes"
    else:
        steps = int(str(settings.get("gradient_accumulation_steps") or 1))
        overrides["gradient_accumulation_steps"] = str(steps * factor)
        accumulation = f"{steps} -> {steps * factor}"
    if settings.get("steps_per_generation") not in (None, ""):  # GRPO/RLOO: the generation batch kept whole too
        overrides["steps_per_generation"] = str(int(str(settings["steps_per_generation"])) * factor)
    return Fix(batch, accumulation, overrides, smaller)


def advice(error: str, settings: Mapping[str, object], envs: Mapping[str, str]) -> str:
    """The line a node prints when its rank's first error is out of memory (empty otherwise): the fix and how to pass
    it to either launcher (TRL_OVERRIDES keeps the words it had)."""
    if not is_oom(error):
        return ""
    fix = propose(settings, envs)
    if fix.overrides is None:
        return f"out of memory: {fix.describe()}"
    from orchestrator.core import overrides

    return f"out of memory: {fix.describe()}: rerun with {fix.words()} {overrides.both_launchers(fix.overrides, envs)}"
