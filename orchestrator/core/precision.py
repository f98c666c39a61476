"""What precision a run really trained in, in words: the facts come from its training processes
(train/precision.py), the line is the same in the first step's output and the run's summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from orchestrator.core import accelerators, memory
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.core.overrides import both_launchers, truthy

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


# NVIDIA's tensor cores (the CUDA programming guide's compute capability table): bf16 from Ampere (8.0), fp8 from Ada
# and Hopper (8.9). Below that torch still runs bf16, emulated (torch.cuda.is_bf16_supported() says True on a T4 or a
# V100: it counts emulation, and transformers' bf16 check asks it), without cuBLAS's fast kernels.
NATIVE = {"bf16": (8, 0), "fp8": (8, 9)}
BF16_NAMES = ("bfloat16", "bf16")


def compute(settings: Mapping[str, object], accelerate_mixed: str) -> str:
    """The mixed precision the trainer's Accelerator runs: TRL's fp16 or bf16 where set, else the Accelerate config's
    (transformers' TrainingArguments: `mixed_precision` from ACCELERATE_MIXED_PRECISION, which `accelerate launch`
    sets from the config, unless fp16 or bf16 is true)."""
    if truthy(settings.get("fp16", False)):
        return "fp16"
    if truthy(settings.get("bf16", False)):
        return "bf16"
    return accelerate_mixed


def needs_bf16(settings: Mapping[str, object], accelerate_mixed: str) -> bool:
    """bf16 compute (compute()) or bf16 weights (`dtype: bfloat16`, also QLoRA's compute dtype): a GPU without bf16
    tensor cores would emulate it."""
    return compute(settings, accelerate_mixed) == "bf16" or str(settings.get("dtype", "")).lower() in BF16_NAMES


def native_bf16(gpu: str) -> bool:
    """The accelerator (as SkyPilot spells it) has bf16 tensor cores; True for those orch has no capability for
    (AMD's: MI300X runs bf16)."""
    return accelerators.CUDA_CAPABILITY.get(gpu.upper(), NATIVE["bf16"]) >= NATIVE["bf16"]


def check_gpu(settings: Mapping[str, object], accelerate_mixed: str, capability: tuple[int, int] | None, gpu: str,
              envs: Mapping[str, str] | None = None, on_node: bool = False) -> None:  # fmt: skip
    """Refuse (OrchError, naming the fix) a precision the GPU has no tensor cores for: bf16 compute or bf16 weights
    (`dtype: bfloat16`, which is also QLoRA's compute dtype) below compute capability 8.0, fp8 below 8.9. Called on
    the launch side with the named accelerator's capability and on the head node with nvidia-smi's; nothing to check
    without one (CPU, AMD). ORCH_PRECISION_CHECK=off runs it anyway. `on_node`: the fix in the words of both
    launchers (`orch run`, and `sky launch --env TRL_OVERRIDES=...` keeping the overrides `envs` has)."""
    if capability is None or knob(envs or {}, "ORCH_PRECISION_CHECK", "on") == "off":
        return
    mixed = compute(settings, accelerate_mixed)
    where = f"{gpu} (compute capability {capability[0]}.{capability[1]})"
    anyway = "; ORCH_PRECISION_CHECK=off runs it anyway"
    bf16_weights = str(settings.get("dtype", "")).lower() in BF16_NAMES
    weights_fix = " dtype=float32" if bf16_weights and capability < NATIVE["bf16"] else ""
    if mixed == "fp8" and capability < NATIVE["fp8"]:
        instead = "bf16=true" if capability >= NATIVE["bf16"] else f"fp16=true{weights_fix}"
        raise OrchError(f"{where} has no fp8 tensor cores (they start at compute capability 8.9: L4, L40S, H100 and "
                        f"newer), which the Accelerate config's mixed_precision: fp8 needs; set "
                        f"{_both(instead, envs, on_node)} or use one of those GPUs{anyway}")  # fmt: skip
    if capability >= NATIVE["bf16"] or not needs_bf16(settings, accelerate_mixed):
        return
    found, fix = [], []
    asked = truthy(settings.get("bf16", False))  # else the Accelerate config's, where bf16 is the compute
    if mixed == "bf16":
        found.append("bf16: true" if asked else "the Accelerate config's mixed_precision: bf16")
    fix += (["bf16=false"] if asked else []) + (["fp16=true"] if mixed != "fp16" else [])
    if bf16_weights:
        found.append(f"dtype: {settings.get('dtype')}")
        fix.append("dtype=float32")
    raise OrchError(
        f"{where} has no bf16 tensor cores (they start at compute capability 8.0: A100, A10G, L4 and newer): with "
        f"{' and '.join(found)} torch would emulate bf16, slowly; set {_both(' '.join(fix), envs, on_node)} (fp16 "
        f"mixed precision over fp32 weights, as these GPUs train) or use an Ampere or newer GPU{anyway}"
    )


def _both(words: str, envs: Mapping[str, str] | None, on_node: bool) -> str:
    """`words` (TRL overrides), and on a node how each launcher takes them (core/overrides.both_launchers)."""
    fix = dict(word.split("=", 1) for word in words.split())
    return f"{words} {both_launchers(fix, envs or {})}" if on_node else words
