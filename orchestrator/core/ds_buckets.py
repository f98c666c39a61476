"""What a DeepSpeed JSON says about the gradient buckets DeepSpeed allocates (core/memory.ds_bucket counts them)."""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core.arch import Arch


def reduce_bucket_of(deepspeed_json: Mapping | None, arch: Arch) -> int:
    """The reduce_bucket_size a DeepSpeed JSON gives, in elements: a number, or "auto", which transformers' DeepSpeed
    config fills with hidden_size squared (trainer_config_finalize); 0 (DeepSpeed's default) without one, or for a
    value DeepSpeed's own config check refuses (the rehearsal says so)."""
    zero = (deepspeed_json or {}).get("zero_optimization")
    value = zero.get("reduce_bucket_size") if isinstance(zero, Mapping) else None
    if value == "auto":
        return arch.hidden * arch.hidden
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        return 0
    return int(value)


def buckets_of(deepspeed_json: Mapping | None, strategy: str) -> int:
    """The reduce buckets DeepSpeed allocates for a DeepSpeed JSON's settings (read back from its optimizer on CPU,
    tests/test_ds_bucket.py): none without contiguous_gradients; ZeRO-1/2 two with overlap_comm (one bucket filling
    while the other reduces), ZeRO-3 one either way."""
    zero = (deepspeed_json or {}).get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    if zero.get("contiguous_gradients") is False:
        return 0
    return 2 if strategy in ("zero1", "zero2") and zero.get("overlap_comm") is True else 1
