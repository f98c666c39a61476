"""What precision a run really trained in, in words: the facts come from its training processes
(train/precision.py), the line is the same in the first step's output and the run's summary."""

from __future__ import annotations

import dataclasses

from orchestrator.core import memory

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
SIXTEEN = {"bfloat16": 256, "float16": 2048}  # 16-bit dtypes: roughly the relative step between neighbouring values


def line(facts: dict | None) -> str | None:
    """`[orch] precision: bf16 compute, fp32 weights updated by the optimizer`, and where the optimizer updates 16-bit
    weights, why: a model loaded in bf16 and trained whole under DDP or one process (accelerate upcasts only under
    FSDP, DeepSpeed keeps fp32 partitions), what that costs and how to keep fp32 weights; or a 4-bit model's adapter,
    which TRL casts."""
    if not facts or not facts.get("compute") or not facts.get("updated"):
        return None
    compute = SHORT.get(facts["compute"], facts["compute"])
    updated = [SHORT.get(d, d) for d in facts["updated"]]
    text = f"[orch] precision: {compute} compute, {' and '.join(updated)} weights updated by the optimizer"
    half = next((d for d in facts["updated"] if d in SIXTEEN), None)
    if half and facts.get("quantized"):
        text += f" (the adapter in {SHORT[half]}: TRL casts a 4-bit model's LoRA adapter so, as the QLoRA paper does)"
    elif half:
        text += (f" (no fp32 copy: an update under ~1/{SIXTEEN[half]} of a weight rounds away; "
                 "dtype=float32 keeps fp32 weights under the same compute, at twice the memory for weights, gradients "
                 "and optimizer states)")  # fmt: skip
    return text


def planned(setup: memory.Setup | None) -> str | None:
    """Before launch, from the memory model's setup: a model loaded in 16 bits and trained whole under DDP (or in one
    process) has its optimizer update 16-bit weights, which the first step reads back; said ahead with what fp32
    weights would take per GPU (the memory model's own estimate), so the choice is made before paying for it."""
    if setup is None or setup.method != "full" or setup.strategy != "ddp" or setup.weights_dtype not in SIXTEEN:
        return None
    half = SHORT[setup.weights_dtype]
    fp32 = memory.estimate(dataclasses.replace(setup, weights_dtype="float32", mixed_precision=True))
    return (f"precision: the optimizer will update {half} weights (DDP over a model loaded in {half}: no fp32 copy, "
            f"an update under ~1/{SIXTEEN[setup.weights_dtype]} of a weight rounds away); dtype=float32 keeps fp32 "
            f"weights under {half} compute at {fp32.describe()}")  # fmt: skip
