"""Checks before anything is provisioned, on the launch side, without a GPU. Each returns nothing or raises
an OrchError that names the fix; `run()` applies the ones that fit the launch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.core import accelerators, models, parallel, strategy
from orchestrator.core.accelerators import Gpus
from orchestrator.core.errors import OrchError
from orchestrator.core.overrides import effective, truthy

GIB = 1024**3
USABLE_FRACTION = 0.9  # of a GPU's memory, leaving room for the CUDA context and fragmentation
# Bytes per parameter with bf16 mixed precision and Adam: bf16 weights 2, bf16 grads 2, fp32 master + m + v 12.
WEIGHTS, GRADS, OPTIMIZER = 2, 2, 12
REFERENCE_TRAINERS = ("dpo", "kto")  # keep a frozen reference copy of the policy


def check_accelerator(gpus: Gpus | str) -> tuple[str, int, int]:
    """`A100:8` -> ("A100", 8, 40): a known accelerator, a positive count, and its memory in GiB."""
    gpus = accelerators.parse(gpus) if isinstance(gpus, str) else gpus
    if gpus.name is None or gpus.name == accelerators.CPU:
        raise OrchError(f"accelerators {str(gpus)!r}: name a GPU type, for example A100:8")
    return gpus.name, gpus.count, accelerators.memory_gib(gpus.name)


def check_process_split(total: int, nodes: int) -> None:
    """accelerate silently runs world size 8 for 10 processes on 4 machines: refuse uneven splits."""
    if nodes < 1 or total < nodes or total % nodes:
        raise OrchError(f"{total} processes cannot be split evenly over {nodes} nodes; give a GPU count per node")


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
    asked = strategy.of(accelerate_config)
    estimate = estimate_memory(params_b, asked.sharding, gpus, trainer, asked.offload, peft)
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
    settings = effective(trl_config, user)
    attn = str(settings.get("attn_implementation") or "sdpa")
    if attn != "sdpa":
        raise OrchError(f"context parallelism needs SDPA attention, not {attn}: set attn_implementation: sdpa")
    fsdp_ac = bool((accelerate_config.get("fsdp_config") or {}).get("fsdp_activation_checkpointing", False))
    if fsdp_ac and truthy(settings.get("gradient_checkpointing", True)):
        raise OrchError(
            "fsdp_activation_checkpointing and TRL's gradient_checkpointing cannot both be on with context "
            "parallelism: set gradient_checkpointing: false in the TRL config"
        )


def check_sequence_parallel(accelerate_config: Mapping) -> None:
    """ALST/Ulysses (sp > 1): DeepSpeed ZeRO-3."""
    sizes = parallel.declared(accelerate_config)
    if sizes and sizes.sp > 1:
        parallel.check_backend(sizes, accelerate_config)


def run(launch, trainer_nodes: int, gpus: Gpus | None) -> MemoryEstimate | None:
    """Every check that applies to a resolved launch (orchestrator.launch.resolved.Launch); returns the memory
    estimate when GPUs are named and the model size is known."""
    accel = launch.paired.accelerate
    model_id = str(launch.setting("model_name_or_path", ""))
    check_fsdp_wrap(accel, model_id)
    check_context_parallel(accel, launch.paired.trl, launch.overrides)
    check_sequence_parallel(accel)
    if gpus is None:
        return None
    name, per_node, _ = check_accelerator(gpus)
    check_process_split(per_node * trainer_nodes, trainer_nodes)
    params_b = models.params_billions(model_id)
    if params_b is None:
        return None
    peft = truthy(launch.setting("use_peft", False))
    return check_memory(params_b, accel, per_node * trainer_nodes, name, launch.trainer, peft)
