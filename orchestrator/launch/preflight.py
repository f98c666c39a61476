"""Checks before anything is provisioned, on the launch side, without a GPU. Each returns nothing or raises
an OrchError that names the fix; `run()` applies the ones that fit the launch."""

from __future__ import annotations

import math
from collections.abc import Mapping

from orchestrator.core import (
    accelerators,
    batch,
    cuda_arch,
    disk_need,
    fit,
    host_fit,
    memory,
    parallel,
    precision,
    vllm_fit,
)
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.accelerators import Gpus
from orchestrator.core.errors import OrchError
from orchestrator.core.final_model import size_words
from orchestrator.core.knobs import knob
from orchestrator.core.load_memory import LoadMemory
from orchestrator.core.overrides import effective, truthy
from orchestrator.launch import storage
from orchestrator.node import model_config

# the rules live in core/fit.py, shared with the head node's check (node/memory.py)
USABLE_FRACTION, HOST_USABLE_FRACTION = fit.USABLE_FRACTION, host_fit.HOST_USABLE_FRACTION
label, smallest_holding = fit.label, fit.smallest_holding


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
    """core.fit.setup_of for a resolved launch (its TRL settings with the overrides), with the model's config.json
    where orch reads one (a model it does not know by name: node/model_config.read)."""
    try:
        found = model_config.read(str(launch.setting("model_name_or_path", "")), launch.setting("model_revision"))
        return fit.setup_of(launch.trainer, launch.settings, launch.paired.accelerate, gpus, found.config, found.where,
                            batch.global_batch_of(launch.envs))  # fmt: skip
    except OrchError as exc:  # a config.json the estimate cannot read: refused unless the check is off
        if memory_checked(launch):
            raise OrchError(f"{exc}; --env ORCH_MEMORY_CHECK=off launches without the estimate") from None
        return None


def unestimated(launch) -> str:
    """Why setup_of gave None for a launch (core.fit.unestimated; a config.json it could not read)."""
    try:
        found = model_config.read(str(launch.setting("model_name_or_path", "")), launch.setting("model_revision"))
        return fit.unestimated(launch.settings, found.config, found.where, found.why)
    except OrchError as exc:
        return str(exc)


def check_memory(setup: memory.Setup, gpu_name: str) -> memory.Estimate:
    """The estimate when it fits one `gpu_name` (the catalog's memory), else an error naming the fix (core.fit)."""
    return fit.check_gpu(setup, accelerators.memory_gib(gpu_name), gpu_name)


def check_host_memory(launch, estimate: memory.Estimate | None, plan) -> str | None:
    """core.host_fit.check_host for the launch's load and CPU offload figures against the planned node's memory
    (SkyPilot's `PlanResult`), or the figures only under ORCH_MEMORY_CHECK=off; None where orch has no figure
    (load_memory)."""
    loading = load_memory(launch, estimate)
    if loading is None:
        return None
    has, whose = (plan.memory_gib, plan.memory_from) if memory_checked(launch) else (None, "ORCH_MEMORY_CHECK=off")
    return host_fit.check_host(loading, has, whose, offloaded_host_gib(launch, estimate))


def offloaded_host_gib(launch, estimate: memory.Estimate | None) -> float:
    """CPU offload's host memory per node while training (core.host_fit.offloaded_gib)."""
    return host_fit.offloaded_gib(estimate.setup if estimate else None, launch.nodes)


def load_memory(launch, estimate: memory.Estimate | None) -> LoadMemory | None:
    """load_memory.at_load for the launch's setup (None where orch has no shape for the model or no GPU named)."""
    if estimate is None or launch.gpus is None or not launch.gpus.name:
        return None
    return at_load(estimate.setup, launch.gpus.count, launch.paired.accelerate)


at_load = fit.at_load


def check_gpu_at_load(loading: LoadMemory, gpu_name: str, bf16: bool = False) -> None:
    """core.fit.check_gpu_at_load against one `gpu_name` (the catalog's memory)."""
    fit.check_gpu_at_load(loading, accelerators.memory_gib(gpu_name), gpu_name, bf16)


def check_fsdp_wrap(accelerate_config: AccelerateConfig | Mapping, model_id: str, revision: object = None) -> None:
    """The FSDP wrap class is the model's decoder layer (a wrong name wraps nothing, silently)."""
    accelerate_config = AccelerateConfig.of(accelerate_config)
    if not accelerate_config.fsdp:
        return
    wrap = accelerate_config.fsdp_wrap
    if not wrap:
        return  # accelerate then wraps the model's _no_split_modules
    try:
        family = model_config.family(model_id, revision)  # its config.json's model_type where it is read
    except OrchError:  # the rehearsal says why
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
    check_fsdp_wrap(accel, model_id, launch.setting("model_revision"))
    check_context_parallel(accel, launch.paired.trl, launch.overrides)
    check_sequence_parallel(accel)
    if gpus is None:
        return None
    name, per_node, _ = check_accelerator(gpus)
    check_process_split(per_node * trainer_nodes, trainer_nodes)
    image = launch.resources.get("image_id") or (launch.recipe.task.get("resources") or {}).get("image_id")
    cuda_arch.check_gpu(name, launch.envs, image)  # the torch build the nodes install has kernels for this GPU
    precision.check_gpu(launch.settings, AccelerateConfig.of(accel).mixed_precision,
                        accelerators.CUDA_CAPABILITY.get(name.upper()), name, launch.envs)  # fmt: skip
    setup = setup_of(launch, per_node * trainer_nodes)
    if setup is None:
        return None
    if not memory_checked(launch):
        check_disk(launch, setup, trainer_nodes)
        return memory.estimate(setup)
    estimate = check_memory(setup, name)
    if trainer_nodes < launch.nodes:  # the last node serves vLLM (VLLM_SERVER_NODES=1)
        tp = vllm_fit.tensor_parallel(launch.envs, per_node)
        vllm_fit.check_vllm_server(setup.arch, accelerators.memory_gib(name), name, per_node, tp)
    check_gpu_at_load(at_load(setup, per_node, accel), name, setup.needs_bf16)
    check_disk(launch, setup, trainer_nodes)
    return estimate


def disk(launch, setup: memory.Setup, trainer_nodes: int) -> disk_need.Need | None:
    """What the fullest node's disk holds at once (core/disk_need.need), None on a Slurm or Kubernetes cluster (no
    disk_size there) or for a disk_size that is not a number (SkyPilot's schema says so)."""
    task = launch.task()
    resources = task.get("resources") or {}
    infra = str(resources.get("infra") or "").lower()
    if infra.split("/")[0] in ("slurm", "k8s", "kubernetes", "ssh"):
        return None
    try:
        size = disk_need.disk_gb(resources)
    except ValueError:
        return None
    model = str(launch.setting("model_name_or_path", ""))
    found = model_config.read(model, launch.setting("model_revision"))
    local = model_config.is_path(model)  # the nodes read it from a path of theirs: no download
    medium, where = storage.medium(task)
    return disk_need.need(setup, trainer_nodes, AccelerateConfig.of(launch.paired.accelerate), launch.settings,
                          medium=medium, where=where, disk_gb=size,
                          download_bytes=None if local else disk_need.stored_bytes(found.config))  # fmt: skip


def check_disk(launch, setup: memory.Setup, trainer_nodes: int) -> None:
    """Refused where the download and the checkpoints outgrow the nodes' disk_size (unless ORCH_DISK_CHECK=off)."""
    need = disk(launch, setup, trainer_nodes)
    if need is None or need.fits or knob(launch.envs, "ORCH_DISK_CHECK", "on") == "off":
        return
    room = math.ceil(need.total / disk_need.GB / 64 + 1) * 64
    fixes = [f"give --disk-size {room} (room for the image, the environment and the datasets too)"]
    if need.kept > 1:
        fixes.append("keep fewer checkpoints (save_total_limit=1)")
    if need.ckpt.layout.startswith("every rank"):
        fixes.append("spread the checkpoint over more nodes (--nodes)")
    if need.where == "the nodes' own disks":
        fixes.append(f"checkpoint to a bucket ({storage.EXAMPLE})")
    raise OrchError(
        f"node {need.node}'s disk is too small for this run: ~{size_words(need.total)} at once "
        f"({need.parts()}; checkpoints: {need.where}) against resources.disk_size {need.disk_gb:g} GB; "
        f"{', or '.join(fixes)}; "
        "--env ORCH_DISK_CHECK=off launches it anyway"
    )


def memory_checked(launch) -> bool:
    """False where the recipe or --env sets ORCH_MEMORY_CHECK=off: the estimates are shown, not enforced."""
    return knob(launch.envs, "ORCH_MEMORY_CHECK", "on") != "off"
