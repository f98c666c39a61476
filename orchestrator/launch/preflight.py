"""Checks before anything is provisioned, on the launch side, without a GPU. Each returns nothing or raises
an OrchError that names the fix; `run()` applies the ones that fit the launch."""

from __future__ import annotations

import math
from collections.abc import Mapping

from orchestrator.core import accelerators, memory, models, parallel, strategy, trainers
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.accelerators import Gpus
from orchestrator.core.errors import OrchError
from orchestrator.core.overrides import effective, truthy

# Of a GPU's memory the estimate (which counts the CUDA context and the allocator's slack) may take: what the driver
# reports usable (an H100 shows 79.6 of its 80 GiB) less a margin.
USABLE_FRACTION = 0.95


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


def setup_of(launch, gpus: int) -> memory.Setup | None:
    """What the memory model needs, from the recipe's TRL and Accelerate configs with the overrides (TRL's and
    PEFT's defaults where a config is silent); None when orch has no shape for the model."""
    arch = models.arch_of(str(launch.setting("model_name_or_path", "")))
    if arch is None:
        return None
    accel = launch.paired.accelerate
    asked = strategy.of(accel)
    peft = truthy(launch.setting("use_peft", False))
    targets = launch.setting("lora_target_modules") or memory.PEFT_DEFAULT_TARGETS
    seq, completion = int(launch.setting("max_length", 1024)), 0
    if trainers.spec(launch.trainer).generates:  # prompt + completion; logits over the completion only
        completion = int(launch.setting("max_completion_length", 512))
        seq = int(launch.setting("max_prompt_length", 512)) + completion
    fsdp_ac = accel.fsdp_activation_checkpointing
    return memory.Setup(
        arch=arch,
        trainer=launch.trainer,
        beta=launch.setting("beta"),
        method=("qlora" if truthy(launch.setting("load_in_4bit", False)) else "lora") if peft else "full",
        strategy=asked.sharding,
        gpus=gpus,
        offload=asked.offload,
        micro_batch=int(launch.setting("per_device_train_batch_size", 8)),
        seq_len=seq,
        completion_len=completion,
        checkpointing=fsdp_ac or truthy(launch.setting("gradient_checkpointing", True)),
        seq_split=asked.cp * asked.sp,
        weights_dtype=str(launch.setting("dtype", "float32")),
        mixed_precision=accel.mixed,
        lora_r=int(launch.setting("lora_r", 16)),
        lora_targets=(targets,) if isinstance(targets, str) else tuple(targets),
        lora_dropout=float(launch.setting("lora_dropout", 0.05)),
        nested_quant=truthy(launch.setting("use_bnb_nested_quant", False)),
        liger=truthy(launch.setting("use_liger_kernel", False)),
    )


def label(setup: memory.Setup) -> str:
    return {"fsdp": "FSDP2", "ddp": "DDP"}.get(setup.strategy, setup.strategy.replace("zero", "ZeRO-")) + (
        " with CPU offload" if setup.offload else ""
    )


def smallest_holding(gib: float) -> str | None:
    """The known accelerator with the least memory whose usable part holds `gib`, None when none does."""
    return next((g for g, mem in sorted(accelerators.KNOWN_GIB.items(), key=lambda kv: kv[1])
                 if mem * USABLE_FRACTION >= gib), None)  # fmt: skip


def check_memory(setup: memory.Setup, gpu_name: str) -> memory.Estimate:
    """The estimate when it fits one `gpu_name`, else an error naming a strategy or an accelerator that fits."""
    estimate = memory.estimate(setup)
    capacity = accelerators.memory_gib(gpu_name)
    if estimate.gib <= capacity * USABLE_FRACTION:
        return estimate
    fixes = []
    for alternative, off in (("fsdp", False), ("zero3", True)):
        other = memory.estimate(memory.with_(setup, strategy=alternative, offload=off))
        if (alternative, off) != (setup.strategy, setup.offload) and other.gib <= capacity * USABLE_FRACTION:
            fixes.append(f"{label(other.setup)} on {setup.gpus} GPUs needs {other.describe().split(' (')[0]}")
            break
    bigger = smallest_holding(estimate.gib)
    if bigger:
        fixes.append(f"or use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB)")
    raise OrchError(
        f"{setup.arch.params / 1e9:.3g}B {setup.trainer} ({setup.method}, {setup.micro_batch} x {setup.seq_len} tokens "
        f"per device) needs {estimate.describe()} under {label(setup)} on {setup.gpus} GPU(s), more than one "
        f"{gpu_name} holds ({capacity} GiB)" + (f"; {', '.join(fixes)}" if fixes else "")
        + "; `orch plan` lists what fits"
    )


# Of a node's host memory loading may take: the OS, the page cache's own slack and SkyPilot's runtime need the rest.
HOST_USABLE_FRACTION = 0.9


def check_host_memory(loading: memory.LoadMemory, plan, offloaded_gib: float = 0.0) -> str:
    """Host memory on the busiest node, at load and, with CPU offload, while training (`offloaded_gib`, its share of
    the offloaded states), against the planned node's (SkyPilot's `PlanResult`): a line saying what was
    checked, or unchecked and why; an OrchError naming the fix when it does not fit."""
    load, has = loading.node / memory.GIB, plan.memory_gib
    said = f"host memory at load: ~{load:.1f} GiB on the busiest node" + (
        f"; ~{offloaded_gib:.1f} GiB per node while training (CPU offload)" if offloaded_gib else "")
    need = max(load, offloaded_gib)
    if has is None:
        return f"{said}, unchecked: {plan.memory_from}"
    if need <= has * HOST_USABLE_FRACTION:
        return f"{said}, fits {has:g} GiB ({plan.memory_from})"
    floor = math.ceil(need / HOST_USABLE_FRACTION)
    what = (f"loading needs ~{load:.1f} GiB of host memory on the busiest node ({loading.path})" if load >= need else
            f"CPU offload needs ~{offloaded_gib:.1f} GiB of host memory per node while training (the node's share "
            "of the weights and Adam's moments)")  # fmt: skip
    raise OrchError(
        f"{what}, more than {HOST_USABLE_FRACTION:.0%} of the {has:g} GiB of {plan.memory_from}; set `memory: "
        f"{floor}+` under resources in the recipe (SkyPilot then plans a node with at least that much)"
        + (", or fsdp_cpu_ram_efficient_loading: true in the Accelerate config (rank 0 alone reads the checkpoint)"
           if load >= need and loading.path.startswith("FSDP:") else "")
        + (", or more nodes (--nodes: each holds a smaller share)" if load < need else "")
    )


def offloaded_host_gib(launch, estimate: memory.Estimate | None) -> float:
    """CPU offload's host memory per node while training, ZeRO-3's or FSDP's (memory.offload_host_gib); 0 without
    offload or where orch has no shape for the model."""
    if estimate is None or not estimate.setup.offload or estimate.setup.strategy not in ("zero3", "fsdp"):
        return 0.0
    return memory.offload_host_gib(estimate.setup, launch.nodes)


def load_memory(launch, estimate: memory.Estimate | None) -> memory.LoadMemory | None:
    """memory.at_load for the launch's setup (None where orch has no shape for the model or no GPU named)."""
    if estimate is None or launch.gpus is None or not launch.gpus.name:
        return None
    return at_load(estimate.setup, launch.gpus.count, launch.paired.accelerate)


def at_load(setup: memory.Setup, per_node: int, accel: AccelerateConfig) -> memory.LoadMemory:
    """memory.at_load for `setup` with the loading path its Accelerate config takes."""
    return memory.at_load(setup, per_node, accel.fsdp_cpu_ram_efficient_loading, accel.fsdp_version,
                          accel.zero3_init_flag, accel.deepspeed_param_offload)  # fmt: skip


def check_gpu_at_load(loading: memory.LoadMemory, gpu_name: str) -> None:
    """The per-GPU peak while loading fits one `gpu_name` (4-bit: every rank quantises the whole model onto its own
    GPU, so more nodes do not help), else an error naming an accelerator that holds it."""
    need, capacity = loading.gpu / memory.GIB, accelerators.memory_gib(gpu_name)
    if need <= capacity * USABLE_FRACTION:
        return
    bigger = smallest_holding(need)
    raise OrchError(
        f"loading needs ~{need:.1f} GiB per GPU ({loading.path}), more than one {gpu_name} holds ({capacity} GiB)"
        + (f"; use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB) or a smaller model" if bigger else
           "; no known accelerator holds it: use a smaller model")
    )  # fmt: skip


def check_fsdp_wrap(accelerate_config: AccelerateConfig | Mapping, model_id: str) -> None:
    """The FSDP wrap class is the model's decoder layer (a wrong name wraps nothing, silently)."""
    accelerate_config = AccelerateConfig.of(accelerate_config)
    if not accelerate_config.fsdp:
        return
    wrap = accelerate_config.fsdp_wrap
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


def check_context_parallel(
    accelerate_config: AccelerateConfig | Mapping, trl_config: Mapping, user: Mapping[str, str]
) -> None:
    """Ring attention (cp > 1): FSDP2, SDPA attention, and activation checkpointing in FSDP or TRL, not both."""
    accelerate_config = AccelerateConfig.of(accelerate_config)
    sizes = accelerate_config.parallelism
    if not sizes or sizes.cp == 1:
        return
    parallel.check_backend(sizes, accelerate_config)
    settings = effective(trl_config, user)
    attn = str(settings.get("attn_implementation") or "sdpa")
    if attn != "sdpa":
        raise OrchError(f"context parallelism needs SDPA attention, not {attn}: set attn_implementation: sdpa")
    fsdp_ac = accelerate_config.fsdp_activation_checkpointing
    if fsdp_ac and truthy(settings.get("gradient_checkpointing", True)):
        raise OrchError(
            "fsdp_activation_checkpointing and TRL's gradient_checkpointing cannot both be on with context "
            "parallelism: set gradient_checkpointing: false in the TRL config"
        )


def check_sequence_parallel(accelerate_config: AccelerateConfig | Mapping) -> None:
    """ALST/Ulysses (sp > 1): DeepSpeed ZeRO-3."""
    accelerate_config = AccelerateConfig.of(accelerate_config)
    sizes = accelerate_config.parallelism
    if sizes and sizes.sp > 1:
        parallel.check_backend(sizes, accelerate_config)


def run(launch, trainer_nodes: int, gpus: Gpus | None) -> memory.Estimate | None:
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
    setup = setup_of(launch, per_node * trainer_nodes)
    if setup is None:
        return None
    estimate = check_memory(setup, name)
    check_gpu_at_load(at_load(setup, per_node, accel), name)
    return estimate
