"""Checks before anything is provisioned, on the launch side, without a GPU. Each returns nothing or raises
an OrchError that names the fix; `run()` applies the ones that fit the launch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator import accelerators, models, parallel
from orchestrator.errors import OrchError

GIB = 1024**3
USABLE_FRACTION = 0.9  # of a GPU's memory, leaving room for the CUDA context and fragmentation
# Bytes per parameter with bf16 mixed precision and Adam: bf16 weights 2, bf16 grads 2, fp32 master + m + v 12.
WEIGHTS, GRADS, OPTIMIZER = 2, 2, 12
REFERENCE_TRAINERS = ("dpo", "kto")  # keep a frozen reference copy of the policy


def check_accelerator(spec: str) -> tuple[str, int, int]:
    """`A100:8` -> ("A100", 8, 40): a known accelerator, a positive count, and its memory in GiB."""
    gpus = accelerators.parse(spec)
    if gpus.name is None or gpus.name == accelerators.CPU:
        raise OrchError(f"accelerators {spec!r}: name a GPU type, for example A100:8")
    return gpus.name, gpus.count, accelerators.memory_gib(gpus.name)


def check_process_split(total: int, nodes: int) -> None:
    """accelerate silently runs world size 8 for 10 processes on 4 machines: refuse uneven splits."""
    if nodes < 1 or total < nodes or total % nodes:
        raise OrchError(f"{total} processes cannot be split evenly over {nodes} nodes; give a GPU count per node")


def strategy_of(accelerate_config: Mapping) -> tuple[str, bool]:
    """(sharding kind, offload) for the memory model: ddp, zero1, zero2, zero3 or fsdp."""
    kind = str(accelerate_config.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        offload = bool((accelerate_config.get("fsdp_config") or {}).get("fsdp_offload_params", False))
        return "fsdp", offload
    if kind == "DEEPSPEED":
        ds = accelerate_config.get("deepspeed_config") or {}
        offload = (
            str(ds.get("offload_param_device", "none")) != "none"
            or str(ds.get("offload_optimizer_device", "none")) != "none"
        )
        return f"zero{ds.get('zero_stage', 0)}", offload
    return "ddp", False


@dataclass(frozen=True)
class MemoryEstimate:
    gib_per_gpu: float
    strategy: str
    gpus: int

    def describe(self) -> str:
        return f"~{self.gib_per_gpu:.1f} GiB per GPU under {self.strategy} on {self.gpus} GPU(s)"


def estimate_memory(
    params_b: float, strategy: str, gpus: int, trainer: str = "sft", offload: bool = False, peft: bool = False
) -> MemoryEstimate:
    """Weights, gradients and Adam states per GPU (activations come on top and depend on sequence length)."""
    n = float(params_b) * 1e9
    trained = 0.0 if peft else 1.0
    if strategy == "ddp":
        per_param = WEIGHTS + trained * (GRADS + OPTIMIZER)
    elif strategy == "zero1":
        per_param = WEIGHTS + trained * (GRADS + OPTIMIZER / gpus)
    elif strategy == "zero2":
        per_param = WEIGHTS + trained * (GRADS + OPTIMIZER) / gpus
    else:  # zero3, fsdp: everything sharded
        per_param = (WEIGHTS + trained * (GRADS + OPTIMIZER)) / gpus
        if offload:  # parameters and optimizer states live in CPU RAM; GPUs keep gradient shards
            per_param = trained * GRADS / gpus
    if trainer in REFERENCE_TRAINERS and not peft:
        per_param += WEIGHTS / gpus if strategy in ("zero3", "fsdp") else WEIGHTS
    label = strategy + ("-offload" if offload else "")
    return MemoryEstimate(n * per_param / GIB, label, gpus)


def check_memory(
    params_b: float, accelerate_config: Mapping, gpus: int, gpu_name: str, trainer: str, peft: bool = False
) -> MemoryEstimate:
    strategy, offload = strategy_of(accelerate_config)
    estimate = estimate_memory(params_b, strategy, gpus, trainer, offload, peft)
    capacity = accelerators.memory_gib(gpu_name)
    if estimate.gib_per_gpu <= capacity * USABLE_FRACTION:
        return estimate
    fixes = []
    for alternative, off in (("fsdp", False), ("zero3", True)):
        other = estimate_memory(params_b, alternative, gpus, trainer, off, peft)
        if other.gib_per_gpu <= capacity * USABLE_FRACTION and other.strategy != estimate.strategy:
            name = "fsdp2" if alternative == "fsdp" else "zero3 with CPU offload"
            fixes.append(f"{name} on {gpus} GPUs needs ~{other.gib_per_gpu:.0f} GiB")
            break
    bigger = next(
        (
            g
            for g, mem in sorted(accelerators.KNOWN_GIB.items(), key=lambda kv: kv[1])
            if mem * USABLE_FRACTION >= estimate.gib_per_gpu
        ),
        None,
    )
    if bigger:
        fixes.append(f"or use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB)")
    raise OrchError(
        f"{params_b:g}B {trainer} needs {estimate.describe()} (weights, gradients, Adam; activations extra), "
        f"more than one {gpu_name} holds ({capacity} GiB)" + (f"; {', '.join(fixes)}" if fixes else "")
    )


def check_fsdp_wrap(accelerate_config: Mapping, model_id: str) -> None:
    """The FSDP wrap class is the model's decoder layer (a wrong name wraps nothing, silently)."""
    if str(accelerate_config.get("distributed_type", "")).upper() != "FSDP":
        return
    wrap = (accelerate_config.get("fsdp_config") or {}).get("fsdp_transformer_layer_cls_to_wrap")
    if not wrap:
        return  # accelerate then wraps the model's _no_split_modules
    try:
        family = models.family_of(model_id)
    except OrchError:
        return
    if wrap != family.decoder_layer:
        raise OrchError(
            f"fsdp_transformer_layer_cls_to_wrap is {wrap} but {model_id} is built of {family.decoder_layer}; "
            f"set fsdp_transformer_layer_cls_to_wrap: {family.decoder_layer} in the Accelerate config"
        )


def check_context_parallel(accelerate_config: Mapping, trl_config: Mapping, user: Mapping[str, str]) -> None:
    """Ring attention (cp > 1): FSDP2, SDPA attention, and activation checkpointing in FSDP or TRL, not both."""
    sizes = parallel.declared(accelerate_config)
    if not sizes or sizes.cp == 1:
        return
    parallel.check_backend(sizes, accelerate_config)
    attn = str(user.get("attn_implementation", trl_config.get("attn_implementation", "sdpa")))
    if attn != "sdpa":
        raise OrchError(f"context parallelism needs SDPA attention, not {attn}: set attn_implementation: sdpa")
    fsdp_ac = bool((accelerate_config.get("fsdp_config") or {}).get("fsdp_activation_checkpointing", False))
    trl_ac = str(user.get("gradient_checkpointing", trl_config.get("gradient_checkpointing", True))).lower()
    if fsdp_ac and trl_ac in ("true", "1", "yes"):
        raise OrchError(
            "fsdp_activation_checkpointing and TRL's gradient_checkpointing cannot both be on with context "
            "parallelism: set gradient_checkpointing: false in the TRL config"
        )


def check_sequence_parallel(accelerate_config: Mapping) -> None:
    """ALST/Ulysses (sp > 1): DeepSpeed ZeRO-3."""
    sizes = parallel.declared(accelerate_config)
    if sizes and sizes.sp > 1:
        parallel.check_backend(sizes, accelerate_config)


def run(
    accelerate_config: Mapping, trl_config: Mapping, user: Mapping[str, str], trainer: str, spec: str | None, nodes: int
) -> MemoryEstimate | None:
    """Every check that applies; returns the memory estimate when the model size is known (GPU launches)."""
    model_id = str(user.get("model_name_or_path", trl_config.get("model_name_or_path", "")))
    check_fsdp_wrap(accelerate_config, model_id)
    check_context_parallel(accelerate_config, trl_config, user)
    check_sequence_parallel(accelerate_config)
    if spec is None:
        return None
    name, per_node, _ = check_accelerator(spec)
    check_process_split(per_node * nodes, nodes)
    params_b = models.params_billions(model_id)
    if params_b is None:
        return None
    peft = str(user.get("use_peft", trl_config.get("use_peft", False))).lower() in ("true", "1", "yes")
    return check_memory(params_b, accelerate_config, per_node * nodes, name, trainer, peft)
