"""Rules a node applies before anything starts: per trainer, per strategy. Each raises an OrchError naming the fix
(the owners' code would stop later, on paid GPUs, or silently do something else)."""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core import attention, batch, final_model, trainers
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.core.overrides import truthy
from orchestrator.core.parallel import Sizes


def check_output_dir(settings: Mapping, env: Mapping[str, str]) -> None:
    """An output_dir (the TRL config's or an override) that names no directory of the run's own: empty, the file
    system root, the directory the ranks start in (the repository; a node's workdir) or one above it, a home. The final
    model (README.md, config.json, model.safetensors, the tokenizer's files) and transformers' checkpoint-* rotation
    would land among that directory's own files. With CHECKPOINT_ROOT set, orch writes to CHECKPOINT_ROOT/<run>
    instead (node/script.py). A local run also checks what the directory holds (core/owned.why_foreign)."""
    import os.path

    if settings.get("output_dir") is None or env.get("CHECKPOINT_ROOT", "").strip():
        return  # none given (`output_dir:` empty in YAML too): transformers' default, trainer_output
    value = str(settings["output_dir"])
    if not value.strip():
        raise OrchError(
            "output_dir= is empty: name the directory the run writes to (output_dir=outputs/my_run), or drop "
            "output_dir= (orch then picks outputs/<run>, or CHECKPOINT_ROOT/<run> on a cluster)"
        )
    plain = os.path.normpath(value)
    parts = plain.split("/")
    if set(parts) <= {"", "."} or set(parts) <= {".."} or (plain.startswith("~") and "/" not in plain):
        where = ("the file system root" if plain.startswith("/") else "a home directory" if plain.startswith("~")
                 else "the directory the run starts in (the recipe's, on a node its workdir)" if plain == "."
                 else "above the directory the run starts in")  # fmt: skip
        raise OrchError(
            f"output_dir={value}: {where}; {final_model.WRITTEN} and checkpoint-* folders would go among its own "
            "files: give the run a directory of its own (output_dir=outputs/my_run), or drop output_dir="
        )


def check_hub_push(settings: Mapping) -> None:
    """transformers' own push (push_to_hub, a TRL config's or an override): rank 0 would upload the whole output_dir
    at every save, orch's reports and Trackio copies included, and create the repo as the trainer is built, which the
    rehearsal (offline) cannot. orch pushes the final model alone, after checking the token before training
    (train/hub.py): the fix names it, with the repo the settings give."""
    if not truthy(settings.get("push_to_hub", False)):
        return
    repo = str(settings.get("hub_model_id") or "OWNER/NAME")
    raise OrchError(
        "push_to_hub=true: transformers would upload the whole output_dir (orch's reports included) at every save; "
        "orch pushes the final model, its token checked before training: drop push_to_hub and pass "
        f"--push-to-hub {repo} --secret HF_TOKEN (with plain sky launch: --env ORCH_PUSH_TO_HUB={repo} --secret "
        "HF_TOKEN)"
    )


def check_strategy_settings(settings: Mapping, device: str, accel_path: str) -> None:
    """The strategy and the device come from the Accelerate config and the node, not from TRL's arguments: transformers'
    own `fsdp` / `deepspeed` turn the recipe's strategy into another (a DDP recipe ran FSDP), which orch's memory
    estimate, resharding and summary do not know; `use_cpu=true` on GPU nodes trains on their CPUs while the GPUs
    idle (the rehearsal said MULTI_CPU). orch sets use_cpu itself where the processes are CPUs."""
    for key in ("fsdp", "deepspeed"):
        value = settings.get(key)
        if value not in (None, "", [], False) and str(value).strip().lower() not in ("", "none", "false", "[]"):
            raise OrchError(f"{key}={value}: TRL's {key} argument sets a strategy beside the Accelerate config's "
                            f"({accel_path}), which orch plans, checks and reports by; drop {key}= and choose the "
                            "strategy there (ACCELERATE_CONFIG=fsdp2, zero3 or a file of yours)")  # fmt: skip
    if device != "cpu" and truthy(settings.get("use_cpu", False)):
        raise OrchError("use_cpu=true: the training processes would run on the nodes' CPUs while their GPUs idle; "
                        "drop use_cpu (orch sets it for --local runs and CPU nodes)")  # fmt: skip


def check_gpu_ids(accelerate_config: AccelerateConfig | Mapping, gpus_per_node: int, accel_path: str) -> None:
    """orch runs one process per GPU of a node (`--num_processes`); an Accelerate config's gpu_ids, which no launch
    argument of orch's replaces, becomes CUDA_VISIBLE_DEVICES: fewer GPUs than processes, and a process past them
    fails on its first CUDA call ('invalid device ordinal'), after the launch."""
    value = AccelerateConfig.of(accelerate_config, accel_path).raw.get("gpu_ids")
    if value is None or str(value).strip().lower() in ("", "all"):
        return
    ids = [part.strip() for part in str(value).split(",")]
    if sorted(ids) == [str(i) for i in range(gpus_per_node)]:
        return  # every GPU of the node, in any order
    raise OrchError(f"{accel_path}: gpu_ids: {value!r} is not every GPU of the node (0-{gpus_per_node - 1}): "
                    "accelerate makes it CUDA_VISIBLE_DEVICES, and orch starts one process per GPU of the node, so a "
                    "process would find no GPU of its own at its first CUDA call; delete gpu_ids (or set it to all) "
                    "and choose the GPUs with --gpus")  # fmt: skip


def check_final_model_is_written(accelerate_config: AccelerateConfig | Mapping, accel_path: str) -> None:
    """ZeRO-3 without 16-bit gathering on save writes only a DeepSpeed checkpoint, which transformers cannot load: the
    Accelerate config's zero3_save_16bit_model, or its DeepSpeed JSON's stage3_gather_16bit_weights_on_model_save
    (read into the same field by core/configs.py; the rehearsal checks it in DeepSpeed's own config too).

    (FSDP's sharded state dict is handled in the training process: orch gathers a full state dict at the end.)
    """
    config = AccelerateConfig.of(accelerate_config, accel_path)
    if not config.deepspeed or config.zero_stage != 3 or config.zero3_save_16bit_model:
        return
    if config.deepspeed_config_file:
        fix = (f"set zero_optimization.stage3_gather_16bit_weights_on_model_save: true in its DeepSpeed JSON "
               f"({config.deepspeed_config_file})")  # fmt: skip
    else:
        fix = "set deepspeed_config.zero3_save_16bit_model: true"
    raise OrchError(f"{accel_path}: ZeRO-3 without 16-bit gathering on save writes the final model as a DeepSpeed "
                    f"checkpoint that transformers cannot load; {fix}")  # fmt: skip


def check_nvme_paths(accelerate_config: AccelerateConfig | Mapping, accel_path: str) -> None:
    """DeepSpeed's offload to nvme swaps to its nvme_path; without one accelerate passes the word "none", which
    DeepSpeed's config takes as a relative path (PosixPath('none')): the swap files would fill ./none/zero_stage_3 on
    the node's boot disk, not its NVMe."""
    config = AccelerateConfig.of(accelerate_config, accel_path)
    for part, path in config.nvme_paths.items():
        if path.strip().lower() in ("", "none"):
            where = (f"zero_optimization.offload_{part}.nvme_path in its DeepSpeed JSON "
                     f"({config.deepspeed_config_file})" if config.deepspeed_config_file else
                     f"deepspeed_config.offload_{part}_nvme_path")  # fmt: skip
            raise OrchError(f"{accel_path}: offload_{part}_device nvme with no path to swap to: DeepSpeed would write "
                            f"its swap files to ./none on the boot disk; set {where} to the nodes' NVMe mount (e.g. "
                            "/local_nvme), or offload to cpu")  # fmt: skip


def check_reference_model_loading(
    trainer: str, accelerate_config: AccelerateConfig | Mapping, settings: Mapping, accel_path: str
) -> None:
    """FSDP2 + cpu-RAM-efficient loading + a frozen reference model (core/trainers.py: DPO, KTO; GRPO with beta != 0):
    transformers loads the weights on each node's first process only and leaves the others empty, counting on a
    broadcast from rank 0 when the model is sharded. accelerate does that broadcast for the policy; TRL's
    `prepare_fsdp` shards the reference model with `fully_shard` alone, so every other rank's shards of the reference
    stay zeros (seen on CPU with FSDP2 for real: 1 node x 2 processes, step-1 DPO loss 0.6949 instead of log 2; the
    reference model's first weight summed to 0.47 against the policy's 2.41). DPO then trains against a broken
    reference, silently. precompute_ref_log_probs does not avoid it: under FSDP, TRL 1.16 builds and shards a reference
    for the precompute alike, and its log-probs came out wrong the same way (step-1 loss 0.6832 with a fresh datasets
    cache, log 2 without cpu-RAM-efficient loading); TRL caches them by rank 0's weights, so a later correct run on the
    same node read the broken ones back."""
    config = AccelerateConfig.of(accelerate_config, accel_path)
    if not config.fsdp or config.fsdp_version != 2 or not config.fsdp_cpu_ram_efficient_loading:
        return
    if truthy(settings.get("use_peft", False)):
        return  # no separate reference model is sharded (precompute_ref_log_probs still builds one under FSDP)
    if trainers.spec(trainer).has_reference(settings):
        raise OrchError(
            f"{accel_path}: fsdp_cpu_ram_efficient_loading with {trainer.upper()}'s reference model under FSDP2 leaves "
            "the reference weights empty on every rank but each node's first (TRL shards it without accelerate's "
            "broadcast); set fsdp_config.fsdp_cpu_ram_efficient_loading: false"
        )


LORA_DROPOUT_DEFAULT = 0.05  # TRL's ModelConfig.lora_dropout


def check_recomputed_dropout(accelerate_config: AccelerateConfig | Mapping, settings: Mapping, accel_path: str) -> None:
    """FSDP2's activation checkpointing (accelerate's fsdp2_apply_ac) wraps each layer with
    `checkpoint_wrapper(layer, preserve_rng_state=False)`: the backward pass recomputes the layer with other random
    numbers, so LoRA's dropout drops other units than the forward pass did and the gradients belong to no forward
    pass (tests/test_node.py shows it with torch's own wrapper). LoRA dropout 0 keeps them exact."""
    config = AccelerateConfig.of(accelerate_config, accel_path)
    if not (config.fsdp and config.fsdp_version == 2 and config.fsdp_activation_checkpointing):
        return
    if not truthy(settings.get("use_peft", False)):
        return
    raw = settings.get("lora_dropout")
    try:
        dropout = LORA_DROPOUT_DEFAULT if raw in (None, "") else float(str(raw))
    except ValueError:
        return  # TRL's parser refuses it, naming the key
    if dropout > 0:
        said = "TRL's default " if raw in (None, "") else ""
        raise OrchError(
            f"lora_dropout is {said}{dropout:g}, but {accel_path}'s fsdp_activation_checkpointing recomputes each "
            "layer without its random state (accelerate's FSDP2 wrapper: preserve_rng_state=False), so the backward "
            "pass drops other units than the forward pass did; set lora_dropout: 0.0, or turn "
            "fsdp_activation_checkpointing off and gradient_checkpointing on"
        )


def check_packing(trainer: str, sizes: Sizes, settings: Mapping) -> None:
    """TRL's SFTTrainer refuses packing with context parallelism: ring attention drops the block-diagonal mask. (Only
    SFT's arguments have packing: TRL's parser refuses the key for any other trainer.)"""
    if sizes.cp < 2:
        return
    for key in ("packing", "eval_packing"):
        if truthy(settings.get(key, False)):
            raise OrchError(
                f"{key} is on, but TRL's {trainers.spec(trainer).trl_class} refuses packing with context parallelism "
                f"(cp_size={sizes.cp}): ring attention drops the mask that keeps packed documents apart; set "
                f"{key}=false"
            )


FLASH = ("flash_attention_2", "flash_attention_3")  # and hub kernels named */flash-attn*


def sp_attention(accelerate_config: AccelerateConfig | Mapping, device: str) -> str:
    """The core attention Ulysses wraps: the config's parallelism_config_sp_attn_implementation (accelerate's default
    sdpa); on CPU always SDPA (node/launcher.py swaps a flash kernel there)."""
    named = AccelerateConfig.of(accelerate_config).sp_attn_implementation or "sdpa"
    return "sdpa" if device == "cpu" else named


def is_flash(attention: str) -> bool:
    return attention in FLASH or ("/" in attention and "flash-attn" in attention)


def check_packed_attention(accelerate_config: AccelerateConfig | Mapping, sizes: Sizes, settings: Mapping, device: str,
                           accel_path: str) -> None:  # fmt: skip
    """Ulysses sequence parallelism (DeepSpeed's UlyssesSPAttentionHF) discards the attention mask transformers built
    (deepspeed/runtime/sequence_parallel/ulysses_sp.py: "SP relies on position_ids ... we discard 4D tensor masks")
    and calls the core attention without one: SDPA is then causal over the whole row, so with packing or padding-free
    rows (several documents, or a DPO pair's sequences, in one row; TRL's BFD packing turns padding-free on) each
    attends to the ones before it, with no error. Only flash attention reads document boundaries from position_ids
    (varlen). DeepSpeed also refuses, once the model is loaded on the GPUs, a model attention other than the core
    one."""
    if sizes.sp < 2:
        return
    core = sp_attention(accelerate_config, device)
    packed = [k for k in ("packing", "padding_free") if truthy(settings.get(k, False))]  # the keys TRL's parser took
    if packed and not is_flash(core):
        where = "on CPU, where orch runs SDPA" if device == "cpu" else f"with {accel_path}'s sp attention {core}"
        raise OrchError(
            f"{' and '.join(packed)} put several documents in one row, but Ulysses sequence parallelism (sp_size="
            f"{sizes.sp}) drops the attention mask and {where} each document attends to the ones before it (only "
            "flash attention keeps them apart, from position_ids); set parallelism_config_sp_attn_implementation and "
            f"attn_implementation to {attention.FLASH_KERNEL} (or flash_attention_2), or "
            f"{' '.join(f'{k}=false' for k in packed)}"
        )
    model = str(settings.get("attn_implementation") or "sdpa")
    if device != "cpu" and model != core:
        raise OrchError(
            f"attn_implementation is {model} but {accel_path}'s parallelism_config_sp_attn_implementation is {core}: "
            "DeepSpeed's Ulysses refuses the pair when it prepares the loaded model (ulysses_sp.py: \"Set both to the "
            f"same value\"); set attn_implementation={core}"
        )


def check_trainer_batch(trainer: str, global_batch: int | None, settings: Mapping, per_step: int = 1,
                        processes: int = 1) -> None:  # fmt: skip
    """The trainer's own batch rules (per_step: per-device batch x data-parallel ranks, which the choices offered keep
    a divisor of the global batch; processes: the training processes, over which an evaluation's groups are whole)."""
    spec = trainers.spec(trainer)
    if spec.generates:
        batch.check_generations(global_batch, settings, trainer, spec.generations_default, per_step)
        batch.check_eval_generations(settings, trainer, spec.generations_default, processes)
    if batch.per_device_batch(settings) < spec.min_micro_batch:
        raise OrchError(
            f"{trainer.upper()} needs per_device_train_batch_size >= {spec.min_micro_batch}: {spec.min_micro_batch_why}"
        )


def cpu_threads(offload: bool, env: Mapping[str, str], cpus: int | None, processes: int) -> tuple[dict, str | None]:
    """(variables the node sets, a note) for the CPU threads of each training process.

    torchrun sets OMP_NUM_THREADS=1 when it is unset (accelerate's DeepSpeed path never sets it), which leaves
    DeepSpeed's CPU Adam and FSDP's CPU optimizer step one thread per process: with offload the node gives each
    process its share of the cores, unless the recipe sets OMP_NUM_THREADS itself. cpus: None on the launch side.
    """
    if not offload or env.get("OMP_NUM_THREADS", "").strip():
        return {}, None
    threads = {"OMP_NUM_THREADS": str(max(1, cpus // processes))} if cpus else {}
    note = f"the optimizer steps on CPU (offload): OMP_NUM_THREADS = the node's cores / {processes} processes"
    return threads, note + (f" = {threads['OMP_NUM_THREADS']}" if threads else "")
