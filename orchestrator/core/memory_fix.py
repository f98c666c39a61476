"""Out of memory, the first GPU failure people hit: recognise it in a rank's first error and name the fix that keeps
the math (the same global batch): the per-device batch halved and the accumulation doubled.

Under GLOBAL_BATCH_SIZE the node computes the accumulation itself, so halving the per-device batch doubles it;
without one, orch doubles gradient_accumulation_steps explicitly. At a per-device batch of 1 nothing is left to
halve: the fix is a strategy that shards more (FSDP, ZeRO-3, offload) or shorter sequences.

Both sides name it: a local run (launch/backends/local_backend.py, with --auto-fit's retry) and every node whose rank
failed out of memory (node/supervise.py, `advice`), so a GPU cluster launched with plain `sky launch` gets it too.
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

    def words(self) -> str:
        return " ".join(f"{k}={v}" for k, v in (self.overrides or {}).items())

    def describe(self) -> str:
        if self.overrides is None:
            return (
                f"the per-device batch is already {self.batch}: shard more (FSDP2, ZeRO-3, CPU offload), enable "
                "gradient_checkpointing=true, or shorten max_length"
            )
        return (
            f"halve the per-device batch ({self.batch} -> {self.batch // 2}) and double the accumulation "
            f"({self.accumulation}): the same global batch, so the same math; or a strategy that shards more"
        )


def propose(settings: Mapping[str, object], envs: Mapping[str, str]) -> Fix:
    batch = int(str(settings.get("per_device_train_batch_size") or TRAINING_ARGUMENTS_DEFAULT_BATCH))
    if batch < 2:
        return Fix(batch, "", None)
    overrides = {"per_device_train_batch_size": str(batch // 2)}
    if str(envs.get("GLOBAL_BATCH_SIZE", "")).strip():
        accumulation = f"GLOBAL_BATCH_SIZE={envs['GLOBAL_BATCH_SIZE']} is kept: orch doubles it on the nodes"
    else:
        steps = int(str(settings.get("gradient_accumulation_steps") or 1))
        overrides["gradient_accumulation_steps"] = str(steps * 2)
        accumulation = f"{steps} -> {steps * 2}" + (
            f"; from an odd batch of {batch} the global batch shrinks" if batch % 2 else ""
        )
    return Fix(batch, accumulation, overrides)


def advice(error: str, settings: Mapping[str, object], envs: Mapping[str, str]) -> str:
    """The line a node prints when its rank's first error is out of memory (empty otherwise): the fix and how to pass
    it to either launcher (TRL_OVERRIDES keeps the words it had)."""
    if not is_oom(error):
        return ""
    fix = propose(settings, envs)
    if fix.overrides is None:
        return f"out of memory: {fix.describe()}"
    import shlex

    from orchestrator.core import overrides

    words = overrides.dumps({**overrides.loads(envs.get("TRL_OVERRIDES", "")), **fix.overrides})
    return (f"out of memory: {fix.describe()}: rerun with {fix.words()} (`orch run RECIPE {fix.words()}`, or "
            f"`sky launch ... --env TRL_OVERRIDES={shlex.quote(words)}`)")  # fmt: skip
