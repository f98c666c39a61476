"""What an Accelerate config asks for, in one record: the label `orch ls` shows and the sharding the memory
model divides by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from orchestrator.core import parallel
from orchestrator.core.accelerate_config import AccelerateConfig


class Strategy(NamedTuple):
    kind: str
    """ddp, zero1, zero2, zero3, fsdp1, fsdp2 or single-gpu."""
    offload: bool
    """Parameters or optimizer states in CPU memory (DeepSpeed offload, FSDP fsdp_offload_params)."""
    cp: int = 1
    sp: int = 1

    @property
    def label(self) -> str:
        """`zero3-offload`, `fsdp2+cp2`, ... as `orch ls` prints it."""
        text = self.kind + ("-offload" if self.offload else "")
        if self.cp > 1:
            text += f"+cp{self.cp}"
        if self.sp > 1:
            text += f"+sp{self.sp}"
        return text

    @property
    def sharding(self) -> str:
        """How the memory model divides weights, gradients and Adam states: ddp, zero1, zero2, zero3 or fsdp."""
        if self.kind.startswith("fsdp"):
            return "fsdp"
        return "ddp" if self.kind == "single-gpu" else self.kind


def of(accelerate_config: AccelerateConfig | Mapping) -> Strategy:
    config = AccelerateConfig.of(accelerate_config)
    sizes = config.parallelism or parallel.Sizes()
    if config.fsdp:
        return Strategy(f"fsdp{config.fsdp_version}", config.fsdp_offload_params, sizes.cp, sizes.sp)
    if config.deepspeed:
        stage = "?" if config.zero_stage is None else config.zero_stage
        return Strategy(f"zero{stage}", config.deepspeed_offload, sizes.cp, sizes.sp)
    return Strategy("ddp" if config.distributed_type == "MULTI_GPU" else "single-gpu", False, sizes.cp, sizes.sp)


def cpu_fallback(s: Strategy, processes: int) -> str | None:
    """Why this strategy cannot train for real on CPU with `processes` ranks (smoke runs fall back to DDP over gloo),
    or None when it can: FSDP2 (with orchestrator/train/cpu_fsdp.py's help), DeepSpeed ZeRO 1/2/3 with or without
    offload, and Ulysses sequence parallelism on ZeRO-3. docs/design/node.md has the table."""
    if s.cp > 1:
        return "context parallelism's ring attention handles only CUDA SDPA kernels (flash, efficient, cuDNN)"
    if s.sp > 1 and processes % s.sp:
        return f"sp_size={s.sp} needs a multiple of {s.sp} processes and this run has {processes}"
    if s.kind == "fsdp1":
        return 'accelerate\'s FSDP1 wrapper asks for a CUDA/XPU-like device ("no available devices found")'
    if s.kind.startswith("fsdp") and s.offload:
        return "FSDP2's CPU offload pins host memory for the copies to the GPU, which needs one (torch's pin_memory)"
    if s.kind in ("fsdp2", "zero1", "zero2", "zero3"):
        return None
    return "not a sharded strategy"


def parallel_sizes(accelerate_config: AccelerateConfig | Mapping, device: str, total: int) -> parallel.Sizes | None:
    """The Accelerate config's parallelism_config refit to `total` processes (None without one, or on CPU where
    it cannot run there: cpu_fallback)."""
    config = AccelerateConfig.of(accelerate_config)
    sizes = config.parallelism
    if sizes is None or (device == "cpu" and cpu_fallback(of(config), total)):
        return None
    parallel.check_backend(sizes, config)
    return parallel.refit(sizes, total)
