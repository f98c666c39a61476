"""Out of memory, the first GPU failure people hit: recognise it in a rank's first error and name the fix that keeps
the math (the same samples an optimizer step): a smaller per-device batch and a longer accumulation.

The smaller batch is the largest at most half the one that failed (a step down that frees memory for sure) among the
batches that keep a rank's samples a step whole (core/batch.smaller, the list the launch-side memory refusal picks
from): per-device 7 x accumulation 2 becomes 2 x 7, not 1 x 14. Under GLOBAL_BATCH_SIZE the nodes derive the
accumulation, so only the batch is given; without one, gradient_accumulation_steps grows with it; a GRPO/RLOO
steps_per_generation grows too, and TRL's generation_batch_size rule holds. Where no batch at most half is whole, the
smallest that is; where none is, the fix is a strategy that shards more (FSDP, ZeRO-3, offload) or shorter sequences.

Both sides name it: a local run (launch/backends/local_backend.py, with --auto-fit's retry) and every node whose rank
failed out of memory (node/supervise.py, `advice`), so a GPU cluster launched with plain `sky launch` gets it too.
Before launch the memory check names the largest smaller batch that fits instead (core/fit.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.core import batch
from orchestrator.core.batch import Smaller

if TYPE_CHECKING:
    from orchestrator.core.parallel import Sizes

# CUDA's allocator (torch.OutOfMemoryError / "CUDA out of memory"), ROCm/HIP's, the CPU allocator's, Python's.
OOM = re.compile(
    r"OutOfMemoryError|CUDA out of memory|HIP out of memory|CUDA error: out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|^MemoryError\b"
)


def is_oom(error: str) -> bool:
    return bool(error and OOM.search(error))


@dataclass
class Fix:
    batch: int
    """The per-device batch that ran out of memory."""
    steps: int = 1
    """Its accumulation (the one GLOBAL_BATCH_SIZE derives, else gradient_accumulation_steps)."""
    smaller: Smaller | None = None
    """The per-device batch proposed and every setting that changes with it (None: no smaller batch keeps the math)."""
    least: int = 1
    """The trainer's least per-device batch (KTO's 2)."""
    why: str = ""
    """The trainer's least per-device batch and why, in words (above 1 only)."""
    global_batch: int | None = None
    """GLOBAL_BATCH_SIZE, where the nodes derive the accumulation from it."""

    @property
    def overrides(self) -> dict[str, str] | None:
        return dict(self.smaller.overrides) if self.smaller else None

    def words(self) -> str:
        return self.smaller.words() if self.smaller else ""

    def describe(self) -> str:
        if self.smaller is None:
            least = self.why if self.least > 1 else ""
            what = (f"the per-device batch is already {self.batch}" + (f" ({least})" if least else "")
                    if self.batch <= self.least else
                    f"no per-device batch below {self.batch} keeps the "
                    f"{self.batch * self.steps} samples a rank takes a step whole" + (f" ({least})" if least else ""))
            return f"{what}: shard more (FSDP2, ZeRO-3, CPU offload), enable gradient_checkpointing=true, or shorten " \
                "max_length"  # fmt: skip
        to, steps = self.smaller.batch, self.batch * self.steps // self.smaller.batch
        factor, whole = divmod(steps, self.steps)
        cut = "halve the per-device batch" if self.batch == 2 * to else "cut the per-device batch"
        grow = ("double the accumulation" if (factor, whole) == (2, 0) else
                f"multiply the accumulation by {factor}" if not whole else "lengthen the accumulation")  # fmt: skip
        how = f"{self.steps} -> {steps}" + (f"; GLOBAL_BATCH_SIZE={self.global_batch} kept, the nodes derive it"
                                            if self.global_batch else "")  # fmt: skip
        return (
            f"{cut} ({self.batch} -> {to}) and {grow} ({how}): the same global batch, so the same math; or a strategy "
            "that shards more"
        )


def propose(settings: Mapping[str, object], envs: Mapping[str, str], processes: int = 1,
            sizes: Sizes | None = None) -> Fix:  # fmt: skip
    """The per-device batch to retry at: of the smaller batches that keep the math for `processes` training processes
    (data-parallel over `sizes`' model-parallel groups) and that the trainer (envs' TRL_TRAINER) accepts
    (core/batch.smaller), the largest at most half the one that failed, else the smallest."""
    from orchestrator.core import trainers

    spec = trainers.SPECS.get(str(envs.get("TRL_TRAINER", "")))
    per_device = batch.per_device_batch(settings)
    global_batch = batch.global_batch_of(envs)
    choices = batch.smaller(settings, global_batch, processes, sizes, spec)
    steps = batch.steps_of(settings, global_batch, batch.data_parallel_of(processes, sizes))
    if not choices:
        return Fix(per_device, steps, least=spec.min_micro_batch if spec else 1,
                   why=f"{spec.name.upper()} takes no less than {spec.min_micro_batch}: {spec.min_micro_batch_why}"
                   if spec else "")  # fmt: skip
    chosen = next((c for c in choices if 2 * c.batch <= per_device), choices[-1])
    return Fix(per_device, steps, chosen, global_batch=global_batch)


def advice(error: str, settings: Mapping[str, object], envs: Mapping[str, str], processes: int = 1,
           sizes: Sizes | None = None) -> str:  # fmt: skip
    """The line a node prints when its rank's first error is out of memory (empty otherwise): the fix and how to pass
    it to either launcher (TRL_OVERRIDES keeps the words it had)."""
    if not is_oom(error):
        return ""
    fix = propose(settings, envs, processes, sizes)
    if fix.overrides is None:
        return f"out of memory: {fix.describe()}"
    from orchestrator.core import overrides

    return f"out of memory: {fix.describe()}: rerun with {fix.words()} {overrides.both_launchers(fix.overrides, envs)}"
