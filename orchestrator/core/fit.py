"""Does a recipe fit the memory it will get: one GPU's while training and while loading (a node's host memory is
core/host_fit.py's). One set of rules, checked twice: by the launch side against SkyPilot's catalog before anything
is provisioned (launch/preflight.py), and by the head node against what its own GPUs report, in the setup, before the
model downloads (node/memory.py), so that a plain `sky launch` with other accelerators gets the same refusal. The
figures are core/memory.py's."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from orchestrator.core import (
    accelerators,
    attention,
    batch,
    cuda_arch,
    dense_attention,
    ds_buckets,
    eval_memory,
    generation_memory,
    load_memory,
    memory,
    models,
    optimizers,
    precision,
    strategy,
    trainers,
)
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import DoesNotFit, OrchError
from orchestrator.core.overrides import eval_strategy, truthy
from orchestrator.core.vllm_fit import VLLM_WEIGHTS_ROOM, check_vllm_room, vllm_words, with_vllm

# Of a GPU's memory the estimate (which counts the CUDA context and the allocator's slack) may take: what the driver
# reports usable (an H100 shows 79.6 of its 80 GiB) less a margin.
USABLE_FRACTION = 0.95
VLLM_DEFAULT_SHARE = 0.3  # TRL 1.16's vllm_gpu_memory_utilization (GRPOConfig, RLOOConfig)
# GRPO and RLOO take each prompt whole (TRL 1.16's GRPOConfig and RLOOConfig have no max_prompt_length): the estimate
# takes prompts of this many tokens and says so (`tokens_words`).
PROMPT_TOKENS = 512


def lengths(trainer: str, max_length: int | str | None = None,
            max_completion_length: int | str | None = None) -> tuple[int, int]:  # fmt: skip
    """(tokens per sequence, of which completion) for a trainer with these TRL settings (None: TRL's default). A
    generating trainer's sequence is a prompt of PROMPT_TOKENS plus its completion, the only part the head scores."""
    if trainers.spec(trainer).generates:
        completion = int(512 if max_completion_length is None else max_completion_length)  # GRPO/RLOOConfig's
        return PROMPT_TOKENS + completion, completion
    return int(1024 if max_length is None else max_length), 0  # TRL's max_length


def _shape(settings: Mapping[str, object], config: Mapping | None, where: str) -> tuple[memory.Arch, str | None] | str:
    """(the model's shape, the setting its bitsandbytes checkpoint loads as) or why setup_of gives None."""
    model = str(settings.get("model_name_or_path") or "")
    arch = models.arch_of(model, config, where)
    if arch is None:
        return f"orch has no shape for {model}"
    try:  # a bitsandbytes checkpoint: counted as load_in_4bit/8bit loads it
        prequantized = models.quantized(model, config, where)
    except OrchError as exc:  # another method: not estimated; the rehearsal refuses it (core/models.family_of)
        return str(exc).split(";")[0]
    if prequantized and not truthy(settings.get("use_peft") or False):
        # transformers refuses to train a quantised model without adapters, in its own words: the rehearsal's
        return f"{model} is a bitsandbytes checkpoint, which trains with adapters only (use_peft true)"
    return arch, prequantized


def unestimated(settings: Mapping[str, object], config: Mapping | None = None, where: str = "", why: str = "") -> str:
    """Why setup_of gives None for these settings and this config.json ('' where it does not); `why`: why no
    config.json was read (node/model_config.Found.why)."""
    shaped = _shape(settings, config, where)
    if not isinstance(shaped, str):
        return ""
    return f"{shaped}, whose config.json was not read: {why}" if config is None and why else shaped


def setup_of(trainer: str, settings: Mapping[str, object], accel: AccelerateConfig, gpus: int,
             config: Mapping | None = None, where: str = "", global_batch: int | None = None) -> memory.Setup | None:
    """What the memory model needs, from the TRL settings the script will see and the Accelerate config (TRL's and
    PEFT's defaults where they are silent) for `gpus` training processes; None when orch has no shape for the model.
    `config`: the model's config.json where it was read (node/model_config.read; `where` names it); `global_batch`:
    the recipe's GLOBAL_BATCH_SIZE, from which the node derives the accumulation."""  # fmt: skip

    def setting(key: str, default=None):
        value = settings.get(key)
        return default if value is None else value

    shaped = _shape(settings, config, where)
    if isinstance(shaped, str):
        return None
    arch, prequantized = shaped
    spec = trainers.spec(trainer)
    asked = strategy.of(accel)
    peft = truthy(setting("use_peft", False))
    targets = setting("lora_target_modules") or memory.PEFT_DEFAULT_TARGETS
    seq, completion = lengths(trainer, setting("max_length"), setting("max_completion_length"))
    # max_length: null (a YAML null: an override cannot give one) truncates nothing: a sequence is as long as its row,
    # which only the model's positions bound; TRL's 1024 counted in its place planned a run its longest row may OOM
    untruncated = "max_length" in settings and settings["max_length"] is None and not spec.generates
    seq = arch.positions if untruncated and arch.positions else seq
    vllm_share, vllm_max_len = 0.0, 0
    evaluates = eval_strategy(setting("eval_strategy")) is not None
    generation_rows = 0
    fewer_rows: tuple[batch.Smaller, ...] = ()  # completions generated fewer at a time (generation_memory.fewer)
    if spec.generates:
        if truthy(setting("use_vllm", False)) and str(setting("vllm_mode", "colocate")) == "colocate":
            vllm_share = float(setting("vllm_gpu_memory_utilization", VLLM_DEFAULT_SHARE))
            vllm_max_len = int(setting("vllm_max_model_length") or 0)
        elif not truthy(setting("use_vllm", False)):
            generation_rows = generation_memory.rows_of(settings, gpus, global_batch)
            fewer_rows = generation_memory.fewer(settings, gpus, global_batch, spec.generations_default)
    return memory.Setup(
        arch=arch,
        trainer=trainer,
        beta=setting("beta"),
        precomputed_ref=truthy(setting("precompute_ref_log_probs", False)),
        method=("qlora" if truthy(setting("load_in_4bit", False)) or prequantized == "load_in_4bit" else "lora")
        if peft else "full",
        strategy=asked.sharding,
        gpus=gpus,
        offload=asked.offload,
        offload_weights=not accel.deepspeed or accel.offload_param_device.lower() not in ("none", ""),
        nvme=tuple(accel.nvme_paths),
        micro_batch=int(setting("per_device_train_batch_size", 8)),
        eval_batch=int(setting("per_device_eval_batch_size", 8)) if evaluates else 0,
        # TRL's GRPO/RLOO config: the eval batch over the processes holds whole groups of num_generations_eval
        eval_group=batch.positive_int(setting("num_generations_eval") or batch.generations(settings,
                                      spec.generations_default), "num_generations_eval") if spec.generates else 1,
        reduce_bucket=ds_buckets.reduce_bucket_of(accel.deepspeed_json, arch),
        # a DeepSpeed JSON with an optimizer section builds DeepSpeed's own (Adam, AdamW, ...) whatever optim says
        optim=optimizers.DEFAULT_OPTIM if "optimizer" in (accel.deepspeed_json or {}) else
        str(setting("optim", optimizers.DEFAULT_OPTIM)),
        reduce_buckets=ds_buckets.buckets_of(accel.deepspeed_json, asked.sharding),
        seq_len=seq,
        untruncated=untruncated,
        full_logits=spec.smooths_labels and float(setting("label_smoothing_factor", 0) or 0) > 0,
        completion_len=completion,
        checkpointing=accel.fsdp_activation_checkpointing or truthy(setting("gradient_checkpointing", True)),
        seq_split=asked.cp * asked.sp,
        dense_attention=dense_attention.kind(attention.requested(settings)[0]),
        batch_shape=dense_attention.batch_shape(trainer, settings),
        weights_dtype=str(setting("dtype", "float32")),
        # the Trainer's Accelerator: TRL's bf16/fp16 where true, else the Accelerate config's (core/precision.py)
        mixed_precision=precision.compute(settings, accel.mixed_precision) not in ("no", "none"),
        needs_bf16=precision.needs_bf16(settings, accel.mixed_precision),
        lora_r=int(setting("lora_r", 16)),
        lora_targets=(targets,) if isinstance(targets, str) else tuple(targets),
        lora_dropout=float(setting("lora_dropout", 0.05)),
        nested_quant=truthy(setting("use_bnb_nested_quant", False)),
        vllm_share=vllm_share,
        vllm_max_len=vllm_max_len,
        vllm_sleeps=vllm_share > 0 and truthy(setting("vllm_enable_sleep_mode", False)),
        generation_rows=generation_rows,
        generation_fewer=fewer_rows,
        # TRL 1.16 gathers every parameter under ZeRO-3 for generate (ds3_gather_for_generation), and to merge a LoRA
        # adapter before it syncs vLLM's weights (VLLMGeneration._iter_named_params, colocated or server)
        generation_gather=spec.generates and (truthy(setting("ds3_gather_for_generation", True))
                                              if not truthy(setting("use_vllm", False)) else peft),
        smaller_batches=batch.smaller(settings, global_batch, gpus, accel.parallelism, spec),
    )


def beyond_positions(setup: memory.Setup, model: str) -> str | None:
    """A warning where the sequences are longer than the positions the model was trained for (memory.Arch.positions:
    config.json's max_position_embeddings, or its rope scaling's reach). Every family orch trains uses rotary
    positions, which compute any position without an error, so nothing else says it: the tokens past it sit at
    positions the model never saw. A generating trainer's completion alone is judged (its prompts' length is not
    known here)."""
    positions = setup.arch.positions
    generates = trainers.spec(setup.trainer).generates
    length, what = (setup.completion_len, "max_completion_length") if generates else (setup.seq_len, "max_length")
    if not positions or length <= positions:
        return None
    return (f"[orch] warning: {what}={length} is beyond the {positions} positions {model} was trained for "
            "(max_position_embeddings in its config.json, no rope scaling reaching further): tokens past them sit at "
            f"positions it never saw, which rotary embeddings compute without a word; shorten {what}, or train a "
            "long-context variant or one whose config.json sets rope_scaling (YaRN)")


def tokens_words(setup: memory.Setup) -> str:
    """The micro-batch's shape as the memory lines give it; for a generating trainer, with its assumed prompt length."""
    words = f"{setup.micro_batch} x {setup.seq_len} tokens per device"
    if setup.seq_split > 1:
        how = "context parallelism" if setup.strategy == "fsdp" else "Ulysses sequence parallelism"
        words += (f", each sequence split over {setup.seq_split} GPUs by {how} "
                  f"({setup.seq_len // setup.seq_split} tokens each)")  # fmt: skip
    if setup.completion_len:
        words += (f" (prompts taken as {setup.seq_len - setup.completion_len} tokens: TRL keeps them whole; "
                  f"{setup.completion_len} completion)")  # fmt: skip
    if setup.full_logits:
        words += " (label_smoothing_factor: the loss takes the whole logits, not TRL's fused head)"
    if setup.untruncated:
        taken = "the model's positions" if setup.seq_len == setup.arch.positions else "TRL's 1024: no positions known"
        words += f" (max_length: null truncates nothing: each sequence taken as {taken})"
    return words


def label(setup: memory.Setup) -> str:
    where = "NVMe" if setup.nvme and (len(setup.nvme) == 2 or not setup.offload_weights) else \
        "CPU and NVMe" if setup.nvme else "CPU"  # fmt: skip
    offload = f" with {where} offload" if setup.offload_weights else \
        f" with the optimizer offloaded to {'the CPU' if where == 'CPU' else where}"  # fmt: skip
    name = {"fsdp": "FSDP2", "ddp": "DDP"}.get(setup.strategy, setup.strategy.replace("zero", "ZeRO-"))
    return name + (offload if setup.offload else "")


def smallest_holding(gib: float = 0.0, *, estimate: memory.Estimate | None = None, bf16: bool = False) -> str | None:
    """The known accelerator with the least memory whose usable part holds `gib`, or else `estimate` with its colocated
    vLLM engine's reserve (which grows with the GPU); with `bf16` (or the estimate's setup needing it) one with bf16
    tensor cores, which the precision check (core/precision.py) would not refuse; never one uv.lock's torch build has
    no kernels for (core/cuda_arch.py); None when none does."""
    bf16 = bf16 or bool(estimate and estimate.setup.needs_bf16)
    return next((g for g, mem in sorted(accelerators.KNOWN_GIB.items(), key=lambda kv: kv[1])
                 if mem * USABLE_FRACTION >= (with_vllm(estimate, mem) if estimate else gib)
                 and (not bf16 or precision.native_bf16(g)) and cuda_arch.runs_lock(g)), None)  # fmt: skip


def check_gpu(setup: memory.Setup, capacity_gib: float, gpu: str) -> memory.Estimate:
    """The estimate when it fits one GPU of `capacity_gib` (`gpu` names it), with a colocated vLLM engine's reserve,
    else an error naming a strategy, a vLLM setting or an accelerator that fits; and a colocated vLLM engine's share
    holds what vLLM needs to start (check_vllm_room)."""
    estimate = memory.estimate(setup)
    usable = capacity_gib * USABLE_FRACTION
    need = with_vllm(estimate, capacity_gib)
    if need <= usable:
        check_vllm_room(setup, capacity_gib, gpu)
        check_evaluation(setup, capacity_gib, gpu)
        generating, fix, settings = generation_memory.refusal(setup, usable)
        if generating:
            during = generation_memory.estimate(setup)
            bigger = None if fix or during is None else smallest_holding(during.gib, bf16=setup.needs_bf16)
            said = (f"{generating} under {label(setup)} on {setup.gpus} GPU(s), more than one {gpu} holds "
                    f"({gib(capacity_gib)} GiB), though training fits")  # fmt: skip
            if settings is None or during is None:
                raise OrchError(said + (f"; use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB)" if bigger else ""))
            raise DoesNotFit(f"{said}; {fix}", settings, f"generating needs ~{during.gib:.1f} GiB of one {gpu}'s "
                             f"{gib(capacity_gib)}; {fix.removeprefix('set ')}")  # fmt: skip
        return estimate
    fixes = []
    if setup.vllm_share and estimate.gib <= usable:  # the trainer alone fits: vLLM's reserve is what does not
        lower = math.floor((usable - estimate.gib) / capacity_gib * 20) / 20  # 0.05 steps
        # vLLM holds its own copy of the weights in its share, and needs room for a KV cache beside it
        floor = setup.arch.params * memory.DTYPE_BYTES.get(setup.weights_dtype, 2) * VLLM_WEIGHTS_ROOM / memory.GIB
        fixes.append(
            (f"vllm_gpu_memory_utilization={lower:g} (a smaller KV cache), " if lower * capacity_gib >= floor else "")
            + ("vllm_enable_sleep_mode=true (vLLM frees its share while the trainer steps), " if not setup.vllm_sleeps
               and with_vllm(memory.estimate(memory.with_(setup, vllm_sleeps=True)), capacity_gib) <= usable else "")
            + "or vLLM on a node of its own (vllm_mode=server with VLLM_SERVER_NODES=1)"
        )  # fmt: skip
    for alternative, off in (("fsdp", False), ("zero3", True)):
        other = memory.estimate(memory.with_(setup, strategy=alternative, offload=off, offload_weights=True))
        same = (alternative, off, True) == (setup.strategy, setup.offload, setup.offload_weights)
        if not same and with_vllm(other, capacity_gib) <= usable:
            fixes.append(f"{label(other.setup)} on {setup.gpus} GPUs needs {other.describe().split(' (')[0]}")
            break
    def step(s: memory.Setup) -> float:
        return with_vllm(memory.estimate(s), capacity_gib)

    smaller = batch.first_fitting(setup.smaller_batches, lambda b: step(memory.with_(setup, micro_batch=b.batch)),
                                  usable)  # fmt: skip
    batch_words = f"{smaller[0].words()} (~{smaller[1]:.1f} GiB; {smaller[0].kept})" if smaller else ""
    if batch_words:
        fixes.insert(0, f"set {batch_words}")  # the same math on the same GPUs
    if flash := flash_fix(setup, step, usable):
        fixes.insert(0, flash)
    if setup.untruncated:  # the likeliest fix: a bound on the rows
        fixes.append("set max_length to the longest sequence the data needs")
    bigger = smallest_holding(estimate=estimate)
    if bigger:
        fixes.append(("or " if fixes else "") + f"use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB)")
    said = (f"{setup.arch.params / 1e9:.3g}B {setup.trainer} ({setup.method}, {tokens_words(setup)}) needs "
            f"{estimate.describe()} under {label(setup)} on {setup.gpus} GPU(s){vllm_words(setup, capacity_gib)}, more "
            f"than one {gpu} holds ({gib(capacity_gib)} GiB)" + (f"; {', '.join(fixes)}" if fixes else "")
            + "; `orch plan` lists what fits")  # fmt: skip
    if smaller is None:
        raise OrchError(said)
    raise DoesNotFit(said, dict(smaller[0].overrides), f"the step needs ~{need:.1f} GiB of one {gpu}'s "
                     f"{gib(capacity_gib)} at per_device_train_batch_size={setup.micro_batch}; "
                     f"{batch_words}")  # fmt: skip


def flash_fix(setup: memory.Setup, need: Callable[[memory.Setup], float], usable: float) -> str:
    """attn_implementation=attention.FLASH_KERNEL where the attention's seq x seq tensors (core/dense_attention.py)
    are what `need` (GiB) finds over `usable`, and flash-attention can take their place (context parallelism needs
    SDPA); else ''."""
    if not setup.dense_attention or setup.seq_split > 1 and setup.strategy == "fsdp":
        return ""
    gib_flash = need(memory.with_(setup, dense_attention=""))
    what = "mask" if setup.dense_attention == "sdpa" else "mask and scores"
    return (f"attn_implementation={attention.FLASH_KERNEL} (flash-attention holds no seq x seq {what}: "
            f"~{gib_flash:.1f} GiB)") if gib_flash <= usable else ""


def check_evaluation(setup: memory.Setup, capacity_gib: float, gpu: str) -> None:
    """An evaluation (eval_strategy) fits one GPU of `capacity_gib` beside the training states and a colocated vLLM
    engine's share (core/eval_memory.py), else an error naming the per_device_eval_batch_size that fits: transformers'
    default is 8 whatever the training batch, so a run that trains at 1 sequence of 32k tokens evaluates 8 at once,
    and met the OOM at its first evaluation, hours in. For GRPO and RLOO the batch keeps TRL's rule: over the
    processes, whole groups of num_generations_eval."""
    usable = capacity_gib * USABLE_FRACTION
    during = eval_memory.estimate(setup)
    if during is None or with_vllm(during, capacity_gib) <= usable:
        return

    def need(batch: int) -> float:
        at = eval_memory.estimate(memory.with_(setup, eval_batch=batch))
        return with_vllm(at, capacity_gib) if at else 0.0

    low, high = 0, setup.eval_batch  # the largest batch that fits, by bisection: the need grows with the batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle) <= usable else (low, middle)
    low = next((b for b in range(low, 0, -1) if b * setup.gpus % setup.eval_group == 0), 0)
    at_low = need(low) if low else 0.0
    fix = (f"set per_device_eval_batch_size={low} (~{at_low:.1f} GiB)" if low else
           "evaluation does not fit at per_device_eval_batch_size=1 either: eval_strategy=no" if setup.eval_group == 1
           else f"evaluation does not fit at any per_device_eval_batch_size TRL takes (x {setup.gpus} processes, whole "
           f"groups of num_generations_eval={setup.eval_group}): eval_strategy=no")  # fmt: skip
    if flash := flash_fix(setup, lambda s: with_vllm(eval_memory.estimate(s) or during, capacity_gib), usable):
        fix += f", or {flash}"
    said = (f"evaluation at {eval_memory.words(setup)} needs {during.describe()} under {label(setup)} on "
            f"{setup.gpus} GPU(s){vllm_words(setup, capacity_gib)}, more than one {gpu} holds "
            f"({gib(capacity_gib)} GiB), though training fits; {fix}")  # fmt: skip
    if not low:
        raise OrchError(said)
    raise DoesNotFit(said, {"per_device_eval_batch_size": str(low)}, f"evaluation needs "
                     f"~{with_vllm(during, capacity_gib):.1f} GiB of one {gpu}'s {gib(capacity_gib)} at "
                     f"per_device_eval_batch_size={setup.eval_batch}; per_device_eval_batch_size={low} "
                     f"(~{at_low:.1f} GiB)")  # fmt: skip


def at_load(setup: memory.Setup, per_node: int, accel: AccelerateConfig) -> load_memory.LoadMemory:
    """load_memory.at_load for `setup` with the loading path its Accelerate config takes."""
    return load_memory.at_load(setup, per_node, accel.fsdp_cpu_ram_efficient_loading, accel.fsdp_version,
                               accel.zero3_init_flag, accel.deepspeed_param_offload)  # fmt: skip


def check_gpu_at_load(loading: load_memory.LoadMemory, capacity_gib: float, gpu: str, bf16: bool = False) -> None:
    """The per-GPU peak while loading fits one GPU of `capacity_gib` (4-bit: every rank quantises the whole model onto
    its own GPU, so more nodes do not help), else an error naming an accelerator that holds it."""
    need = loading.gpu / memory.GIB
    if need <= capacity_gib * USABLE_FRACTION:
        return
    bigger = smallest_holding(need, bf16=bf16)
    raise OrchError(
        f"loading needs ~{need:.1f} GiB per GPU ({loading.path}), more than one {gpu} holds ({gib(capacity_gib)} GiB)"
        + (f"; use {bigger} ({accelerators.KNOWN_GIB[bigger]} GiB) or a smaller model" if bigger else
           "; no known accelerator holds it: use a smaller model")
    )  # fmt: skip


def gib(value: float) -> str:
    """12, 23.54, 0.75: a memory size in GiB as people write it."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


STRATEGIES = ("ddp", "fsdp", "zero3")  # fastest first: replicas, then FSDP2, then ZeRO-3 (same states, by this model)


@dataclass(frozen=True)
class Fit:
    nodes: int
    estimate: memory.Estimate


def smallest_fit(base: memory.Setup, capacity_gib: float, gpus_per_node: int, max_nodes: int, offload: bool = False,
                 need: Callable[[memory.Estimate], float] | None = None,
                 strategies: tuple[str, ...] = STRATEGIES) -> Fit | None:  # fmt: skip
    """The fewest nodes, and at that count the fastest strategy, whose estimate and peak while loading (at_load: 4-bit
    puts the whole quantised model on every GPU) fit `capacity_gib`; None when nothing does up to max_nodes. With
    offload, ZeRO-3 with CPU offload only. `need`: GiB one GPU needs at the run's peak for an estimate, where more
    than the step counts (core/vllm_fit.with_vllm: a colocated vLLM engine; an evaluation); `strategies`: the ones to
    try (context parallelism runs under FSDP2 only, Ulysses under ZeRO-3 only); node counts whose GPUs the base's
    context- or sequence-parallel degree does not divide are skipped."""
    strategies = ("zero3",) if offload else strategies
    for nodes in range(1, max_nodes + 1):
        if nodes * gpus_per_node % base.seq_split:
            continue
        for sharding in strategies:
            step = memory.estimate(replace(base, strategy=sharding, offload=offload, gpus=nodes * gpus_per_node))
            loading = load_memory.at_load(step.setup, gpus_per_node, cpu_ram_efficient=True, params_on_host=offload)
            peak = need(step) if need else step.gib
            if peak <= capacity_gib and loading.gpu / memory.GIB <= capacity_gib:
                return Fit(nodes, step)
    return None
