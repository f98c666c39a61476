"""Per-GPU memory of a training step, from the model's shape and what the recipe asks for (no torch import).

    weights + gradients + optimizer states   (per strategy: what is sharded over how many ranks, in which dtype)
  + frozen weights                          (LoRA's base model, 16-bit or 4-bit; a trainer's reference model)
  + activations                             (tokens per micro-batch, per layer, checkpointed or not, split by CP/SP)
  + LM head                                 (TRL's fused head: one token x vocabulary tile, never the whole logits)
  + gathered units / buckets                (FSDP and ZeRO-3 all-gather one decoder layer ahead; DDP's buckets;
                                             DeepSpeed's gradient bucket, a fixed 5e8 elements)
  + overhead                                (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation)

The byte counts follow what the libraries really do, read from their code (accelerate 1.15, DeepSpeed 0.19,
PEFT 0.21, bitsandbytes 0.50): accelerate upcasts *trainable* parameters to fp32 under FSDP with mixed precision
(fp32 weights, gradients and Adam moments: 16 bytes a parameter, frozen ones keep their dtype); DeepSpeed keeps
bf16 weights and gradients and an fp32 master copy with the moments (2 + 2 + 12, the ZeRO paper's accounting);
plain DDP on a bf16-loaded model trains in bf16 (AdamW's moments take the parameter's dtype) and its reducer holds
a second copy of the gradients in buckets; PEFT keeps adapters in fp32 (autocast_adapter_dtype), except that TRL
casts a 4-bit model's adapter to bf16 (its trainers, after the QLoRA paper); NF4 stores 4 bits
a weight plus one absmax per 64 (8-bit with nested quantisation, plus an fp32 per 256 of those), and leaves the
embeddings and lm_head in 16 bits. docs/design/memory.md has the activation terms; tests/test_memory.py checks the model
against published measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from orchestrator.core import dense_attention, trainers
from orchestrator.core.arch import Arch, positions_of  # noqa: F401  (memory.Arch and memory.positions_of to callers)
from orchestrator.core.batch import Smaller
from orchestrator.core.optimizers import DEFAULT_OPTIM, optim_bytes

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
# nvidia-smi-style figures include what the caching allocator holds beyond the live tensors and the CUDA context.
FRAGMENTATION = 0.10  # of the live peak: the allocator's reserved-but-free blocks
CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces, NCCL buffers
NF4_BYTES = {True: (4 + 8 / 64 + 32 / (64 * 256)) / 8, False: (4 + 32 / 64) / 8}  # nested quantisation or not
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama, Qwen, Mistral when none are named


@dataclass(frozen=True)
class Setup:
    """One training step's memory-relevant settings; defaults are TRL 1.16's and PEFT's."""

    arch: Arch
    trainer: str = "sft"
    method: str = "full"
    """full, lora or qlora."""
    strategy: str = "fsdp"
    """ddp, zero1, zero2, zero3 or fsdp."""
    gpus: int = 8
    """Ranks the sharded states are split over."""
    offload: bool = False
    offload_weights: bool = True
    """With offload: the weights leave the GPUs too (FSDP's fsdp_offload_params, DeepSpeed's offload_param_device);
    False for offload_optimizer_device alone (ZeRO-Offload): the 16-bit weights stay, the optimizer moves (states)."""
    nvme: tuple[str, ...] = ()
    """DeepSpeed's offloads that go to NVMe, not host memory ("param", "optimizer"; ZeRO-Infinity): core/host_fit.py."""
    micro_batch: int = 8
    optim: str = DEFAULT_OPTIM
    """transformers' optim (core/optimizers.py); DeepSpeed's own AdamW for a DeepSpeed JSON's optimizer section."""
    reduce_bucket: int = 0
    """DeepSpeed's reduce_bucket_size in elements (reduce_bucket_of), 0 for its default (DS_REDUCE_BUCKET)."""
    reduce_buckets: int = 1
    """How many such buckets DeepSpeed holds (buckets_of)."""
    seq_len: int = 1024
    full_logits: bool = False
    """SFT with label_smoothing_factor > 0: the loss takes the whole logits (`full_logits`), not TRL's fused head."""
    untruncated: bool = False
    """TRL's max_length is null: nothing is truncated, and seq_len is the model's positions (fit.setup_of)."""
    completion_len: int = 0
    """A generating trainer's (GRPO, RLOO) completion part of seq_len, the only part the LM head scores."""
    precomputed_ref: bool = False
    """precompute_ref_log_probs (DPO, KTO): the reference's log-probs are computed before training, so no reference
    model is held while training (TRL builds none, or under FSDP frees the one it built for the precompute)."""
    beta: float | str | None = None
    """The KL coefficient of a trainer whose reference model depends on it, as the TRL config or an override gives
    it (None: TRL's default)."""
    checkpointing: bool = True
    dense_attention: str = ""
    """"sdpa" or "eager" where the attention holds seq x seq tensors (core/dense_attention.py), "" for flash-attention
    and the kernels that hold none."""
    batch_shape: str = "padded"
    """How a micro-batch reaches the model (dense_attention.batch_shape): "padded", "flattened" or "full"."""
    seq_split: int = 1
    """Context- or sequence-parallel degree: each rank holds seq_len / seq_split tokens of a sequence."""
    weights_dtype: str = "bfloat16"
    mixed_precision: bool = True
    needs_bf16: bool = False
    """bf16 compute or weights (core/precision.py needs_bf16): an accelerator a memory refusal offers instead has bf16
    tensor cores."""
    lora_r: int = 16
    lora_targets: tuple[str, ...] = PEFT_DEFAULT_TARGETS
    lora_dropout: float = 0.05
    nested_quant: bool = False
    vllm_share: float = 0.0
    """The fraction of each GPU a colocated vLLM engine reserves for itself (TRL's vllm_gpu_memory_utilization with
    vllm_mode colocate; vLLM takes it of the GPU's total, per engine, whatever the trainer holds): core/fit.py adds
    it to the estimate, which is the trainer's alone."""
    vllm_max_len: int = 0
    """TRL's vllm_max_model_length, the engine's max_model_len (0: vLLM's default, the model's positions)."""
    eval_batch: int = 0
    """per_device_eval_batch_size where the trainer evaluates (an eval_strategy), else 0 (core/eval_memory.py)."""
    eval_group: int = 1
    """GRPO/RLOO: num_generations_eval, whose whole groups the eval batch over the processes must hold (TRL's rule)."""
    generation_rows: int = 0  # completions a rank generates at once with transformers' generate (use_vllm false)
    generation_gather: bool = False  # ZeRO-3 gathers the whole model to generate or sync vLLM (generation_memory)
    generation_fewer: tuple[Smaller, ...] = ()  # smaller generation batches TRL takes (generation_memory.fewer)
    vllm_sleeps: bool = False
    """vllm_enable_sleep_mode: the engine frees its share while the trainer steps (level 2), and holds it while it
    generates, beside the trainer's states."""
    smaller_batches: tuple[Smaller, ...] = ()
    """The per-device batches below micro_batch that keep the run's math (core/batch.smaller), largest first: a
    refusal names the largest that fits (core/batch.first_fitting)."""


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    parts: dict[str, float] = field(default_factory=dict)  # GiB per GPU, by part

    @property
    def gib(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{k} {v:.1f}" for k, v in self.parts.items() if v >= 0.05)
        return f"~{self.gib:.1f} GiB per GPU ({shown})"


def _targets(setup: Setup) -> list[str]:
    """The linear layers LoRA adapts (`all-linear`: every one)."""
    return list(LINEARS) if "all-linear" in setup.lora_targets else [t for t in setup.lora_targets if t in LINEARS]


def trained_params(setup: Setup) -> int:
    """Parameters with gradients and optimizer states: the LoRA adapters' r x (in + out) per adapted layer, or all."""
    if setup.method not in ("lora", "qlora"):
        return setup.arch.params
    shapes = setup.arch.linears()
    return setup.arch.layers * sum(setup.lora_r * (shapes[n][0] + shapes[n][1]) for n in _targets(setup))


def per_parameter(setup: Setup) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of a trained parameter (core/disk_need.py's checkpoint bytes too)."""
    dtype, s, optim = DTYPE_BYTES[setup.weights_dtype], setup.strategy, setup.optim
    if setup.method == "qlora" and not s.startswith("zero"):  # TRL casts a 4-bit model's adapter to bf16 (read back:
        return 2, 2, optim_bytes(optim, 2)  # train/precision.py); accelerate's FSDP upcast skips 4-bit models
    if setup.method in ("lora", "qlora"):
        return 4, 4, optim_bytes(optim, 4)  # PEFT's fp32 adapters, the optimizer's states on them
    if s.startswith("zero"):
        return 2, 2, 4 + optim_bytes(optim, 4)  # bf16 weights and gradients; fp32 master, Adam's m and v
    if s == "fsdp" and setup.mixed_precision:
        return 4, 4, optim_bytes(optim, 4)  # accelerate upcasts trainable parameters to fp32
    return dtype, dtype, optim_bytes(optim, dtype)  # AdamW's moments take the parameter's dtype


def states(setup: Setup) -> dict[str, float]:
    """Bytes per GPU of trained weights, their gradients and optimizer states, and frozen weights."""
    a, n, s = setup.arch, setup.gpus, setup.strategy
    dtype = DTYPE_BYTES[setup.weights_dtype]
    peft = setup.method in ("lora", "qlora")
    trained = trained_params(setup)
    sharded = s in ("fsdp", "zero3")
    w, g, opt = per_parameter(setup)
    split = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n)}.get(s, (n, n, n))
    out = {"weights": trained * w / split[0], "gradients": trained * g / split[1]}
    out["optimizer"] = trained * opt / split[2]
    if s == "ddp":
        out["gradients"] += trained * g  # the reducer's buckets (gradient_as_bucket_view is off)
    if setup.offload and setup.offload_weights:  # ZeRO-3 keeps a bf16 gradient shard; FSDP nothing between steps
        out = {"weights": 0.0, "gradients": out["gradients"] if s == "zero3" else 0.0, "optimizer": 0.0}
    elif setup.offload:  # the optimizer alone: ZeRO-2 copies each reduced gradient bucket to the host partition, ZeRO-1
        # reduces the whole gradient at the end of the backward, ZeRO-3 keeps its bf16 gradient shard (as above)
        out = {"weights": out["weights"], "gradients": 0.0 if s == "zero2" else out["gradients"], "optimizer": 0.0}
    frozen = 0.0
    replicated = 0.0
    if peft:
        linear = a.layers * a.layer_linear_params
        per_linear = NF4_BYTES[setup.nested_quant] if setup.method == "qlora" else dtype
        frozen = loaded_bytes(setup)
        if setup.method == "qlora" and sharded:  # the quantisation scales (bitsandbytes' quant_state) are not
            replicated = linear * (per_linear - 0.5)  # parameters: FSDP leaves a full copy on every rank
            frozen -= replicated
    if has_reference(setup):  # a frozen copy, sharded alike
        frozen += a.params * dtype
    resident = not (setup.offload and setup.offload_weights)
    out["frozen weights"] = frozen / (n if sharded else 1) + replicated if resident else 0.0
    return out


def layer_bytes_per_token(setup: Setup) -> float:
    """Bytes one decoder layer keeps for backward per token, in 16-bit compute: both norms' inputs and outputs,
    q and the attention output, k and v, the MLP's gate, up, activation and product (attention by SDPA/flash
    keeps no seq x seq matrix); LoRA with dropout keeps each adapted input again and a 1-byte mask."""
    a = setup.arch
    q, kv = a.heads * a.hd, a.kv_heads * a.hd
    elements = 4 * a.hidden + 2 * q + 2 * kv + 4 * a.intermediate
    extra = 0.0
    if setup.method in ("lora", "qlora") and setup.lora_dropout > 0:
        shapes = a.linears()
        extra = sum(3 * shapes[t][0] for t in _targets(setup))
    return 2 * elements + extra


def activations(setup: Setup) -> dict[str, float]:
    a = setup.arch
    spec = trainers.spec(setup.trainer)
    tokens = setup.micro_batch * setup.seq_len * spec.rows_per_sample / setup.seq_split
    layer = layer_bytes_per_token(setup)
    if setup.checkpointing:  # each layer's input, plus one layer recomputed in backward
        act = tokens * (a.layers * 2 * a.hidden + layer)
    else:
        act = tokens * a.layers * layer
    head, compute = 0.0, compute_bytes(setup)
    dense = {dense_attention.PART[setup.dense_attention]: dense_attention.training(setup, compute)} \
        if setup.dense_attention else {}  # fmt: skip
    if setup.full_logits:
        return {"activations": act, **dense, "logits": full_logits(setup, tokens, compute)}
    if spec.fused_head:
        scored = setup.micro_batch * setup.completion_len if spec.generates else tokens
        head = sum(lm_head(scored, a.vocab, a.hidden, trained=setup.method == "full", compute=compute,
                           zero3=setup.strategy == "zero3").values())  # fmt: skip
    return {"activations": act, **dense, "lm head": head}


def compute_bytes(setup: Setup) -> int:
    """Bytes an activation takes: 16-bit under mixed precision or with 16-bit weights, else fp32."""
    return 2 if setup.mixed_precision or DTYPE_BYTES[setup.weights_dtype] == 2 else 4


def full_logits(setup: Setup, tokens: float, compute: int) -> float:
    """SFT with label_smoothing_factor > 0: TRL 1.16 takes the loss from transformers' LabelSmoother over the model's
    own tokens x vocabulary logits, not its fused head: at the peak the logits, their shifted copy, the log-softmax and
    its negation, 16 bytes an entry (fp32, or bf16 logits under CUDA's autocast, which runs log_softmax in fp32), 10 in
    pure 16-bit; then, the log-softmax kept for the backward, a no-grad fused forward for the metrics (one layer's
    working set, eval_layer). Measured on CPU (tests/test_label_smoothing_memory.py)."""
    entries = tokens * setup.arch.vocab
    wide = 16 if compute == 4 or setup.mixed_precision else 10
    kept = 4 if wide == 16 else 2
    return max(entries * wide, entries * kept + eval_layer(setup.arch) * tokens * compute)


# TRL's fused LM head works in tiles of TOKEN_CHUNK_SIZE tokens (trl/kernels/chunked_logprob.py) by
# _CHUNKED_LOGPROB_CHUNK_SIZE vocabulary columns (trl/trainer/utils.py); tests/test_lm_head_memory.py pins them.
HEAD_TILE = (4096, 32768)


def lm_head(tokens: float, vocab: int, hidden: int, *, trained: bool, compute: int = 2, zero3: bool = False,
            tile: tuple[int, int] = HEAD_TILE) -> dict[str, float]:  # fmt: skip
    """Bytes TRL 1.16's fused LM head holds at its peak, the end of its backward (trl/trainer/utils.add_fused_lm_head,
    trl/kernels/chunked_logprob.ChunkedLogProbFunction). SFT, DPO, KTO, GRPO and RLOO all score tokens through it,
    whatever use_liger_kernel says (TRL turns Liger's fused loss off), so the tokens x vocabulary logits never exist
    whole. It holds one tile in the compute dtype (the backward recomputes each tile into it and turns it into the
    logits' gradient in place), the hidden states' gradient (an fp32 accumulator, then its copy in their dtype) beside
    the copy of the scored hidden states the forward saved, and with the head trained (full fine-tuning) its weight's
    gradient (fp32, then its copy in the weight's dtype); ZeRO-3 gathers the head's weight for it
    (maybe_gather_lm_head_ctx). FSDP2's gathered head is accelerate's tail unit (`transient`)."""
    cast = compute if compute < 4 else 0  # .to(float32) of an fp32 accumulator is the same tensor
    rows, cols = tile
    return {
        "tile": min(tokens, rows) * min(vocab, cols) * compute,
        "scored hidden states": tokens * hidden * compute,  # add_fused_lm_head copies them for the function
        "hidden-state gradient": tokens * hidden * (4 + cast),
        "head gradient": vocab * hidden * (4 + cast) if trained else 0.0,
        "gathered head": vocab * hidden * compute if zero3 else 0.0,
    }


def loaded_bytes(setup: Setup) -> float:
    """The whole model as it is loaded: its linear layers in 4 bits (NF4 and its scales) under QLoRA, the rest and
    every other model in the weights' dtype (what ZeRO-3 gathers whole for generate: core/generation_memory.py)."""
    a, dtype = setup.arch, DTYPE_BYTES[setup.weights_dtype]
    if setup.method != "qlora":
        return a.params * dtype
    return a.layers * a.layer_linear_params * NF4_BYTES[setup.nested_quant] + a.other_params * dtype


def transient(setup: Setup, backward: bool = True) -> float:
    """FSDP and ZeRO-3 gather the running layer and prefetch the next, and hold one layer's full gradients
    before the reduce-scatter (in a backward)."""
    if setup.strategy not in ("fsdp", "zero3"):
        return 0.0
    a = setup.arch
    per = NF4_BYTES[setup.nested_quant] if setup.method == "qlora" else 2
    grads = 0 if setup.method in ("lora", "qlora") or not backward else a.layer_linear_params * 4
    # accelerate's FSDP2 prepare keeps [final norm, lm_head] (with tied weights, the input embedding too: one tensor)
    # gathered from forward to backward (its own unit, reshard_after_forward=False): the output embedding in bf16
    tail = a.vocab * a.hidden * 2 if setup.strategy == "fsdp" else 0
    return 2 * a.layer_linear_params * per + grads + tail


# DeepSpeed 0.19's reduce_bucket_size (ZeroConfig's default, in elements): accelerate's DeepSpeed plugin never sets it
# from an Accelerate config, so every shipped ZeRO recipe runs with it
DS_REDUCE_BUCKET = 500_000_000


def ds_bucket(setup: Setup) -> float:
    """DeepSpeed's contiguous gradient bucket (contiguous_gradients, on by default): reduce_bucket_size elements in the
    gradients' dtype on every GPU, whatever the model's size (~0.93 GiB in bf16). ZeRO-3 allocates it as its
    optimizer is built, in accelerate's prepare, and keeps it; ZeRO-1 and 2 allocate one at each backward (two with
    overlap_comm, off by default for them) and free it after the reduction. Measured: 955.8 MiB at the end of prepare
    on an H100 for the ZeRO-3 smoke run (docs/gpu.md); tests/test_ds_bucket.py reads it from DeepSpeed's optimizer.
    A DeepSpeed JSON's own reduce_bucket_size is read (setup.reduce_bucket)."""
    if not setup.strategy.startswith("zero"):
        return 0.0
    elements = (setup.reduce_bucket or DS_REDUCE_BUCKET) * setup.reduce_buckets
    return elements * (2 if setup.mixed_precision or DTYPE_BYTES[setup.weights_dtype] == 2 else 4)


def estimate(setup: Setup) -> Estimate:
    parts = {**states(setup), **activations(setup), "gathered": transient(setup), "gradient bucket": ds_bucket(setup)}
    return with_overhead(setup, parts)


def with_overhead(setup: Setup, parts: dict[str, float]) -> Estimate:
    """The Estimate of these live bytes by part, with the allocator's slack and the CUDA context, in GiB."""
    parts["overhead"] = sum(parts.values()) * FRAGMENTATION + CONTEXT_GIB * GIB
    return Estimate(setup, {k: v / GIB for k, v in parts.items()})


def eval_forward(setup: Setup) -> float:
    """Bytes an evaluation's forward holds at its peak (no gradients: nothing is kept for a backward), for
    per_device_eval_batch_size sequences: one decoder layer's working tensors for every token, the residual stream and
    its norm beside the MLP's activation, up projection and their product (and Phi-3's fused gate_up output), or the
    attention's q, k, v and their rotated copies; after the last layer, TRL's fused LM head's input, its scored copy and
    one tile. Read back on CPU from transformers' Llama, Qwen2, Qwen3 and Phi-3 (tests/test_eval_memory.py). No CP or SP
    split: TRL's prediction_step runs no context-parallel split, and accelerate adapts only the training dataloader to
    Ulysses, so each rank evaluates whole sequences. Where attention is not flash-attention, its seq x seq mask
    through the forward, and its bias or scores while a layer attends (core/dense_attention.py)."""
    a, tokens, compute = setup.arch, eval_tokens(setup), compute_bytes(setup)
    head = 2 * a.hidden * tokens + min(tokens, HEAD_TILE[0]) * min(a.vocab, HEAD_TILE[1])
    held, attending = dense_attention.evaluation(setup, compute)
    mlp, attends = eval_layer(a, attention=False) * tokens * compute, eval_layer(a, mlp=False) * tokens * compute
    layer = max(mlp, attends + attending)
    return max(layer, head * compute if trainers.spec(setup.trainer).fused_head else 0) + held


def eval_tokens(setup: Setup) -> int:
    """Tokens one evaluation forward takes: per_device_eval_batch_size rows of the trainer's (DPO: chosen and
    rejected), each as long as a training sequence."""
    return setup.eval_batch * setup.seq_len * trainers.spec(setup.trainer).rows_per_sample


def eval_layer(a: Arch, *, mlp: bool = True, attention: bool = True) -> int:
    """Elements per token one decoder layer's forward holds at once without gradients (eval_forward): while its MLP
    works, or while it attends."""
    q, kv = a.heads * a.hd, a.kv_heads * a.hd
    return max(4 * a.hidden + (4 if a.fused_mlp else 3) * a.intermediate if mlp else 0,
               3 * a.hidden + 5 * q + 3 * kv if attention else 0)  # fmt: skip


def between_steps(setup: Setup) -> dict[str, float]:
    """The states an evaluation or a generation finds: the step's zero_grad freed the gradients, not DDP's buckets
    nor ZeRO-3's partition."""
    parts = states(setup)
    if setup.strategy != "zero3":
        parts["gradients"] = parts["gradients"] / 2 if setup.strategy == "ddp" else 0.0
    return parts


with_ = replace  # memory.with_(setup, strategy="zero3"): the Setup with those fields changed


def has_reference(setup: Setup) -> bool:
    """Whether TRL holds a separate frozen reference model while training (never with PEFT: it disables the adapter
    instead; nor with precompute_ref_log_probs)."""
    return builds_reference(setup) and not setup.precomputed_ref


def builds_reference(setup: Setup) -> bool:
    """Whether TRL builds a separate reference model at all: under FSDP it does for precompute_ref_log_probs too, and
    frees it before the first step (trl/trainer/dpo_trainer.py, kto_trainer.py)."""
    held = trainers.spec(setup.trainer).has_reference({} if setup.beta is None else {"beta": setup.beta},
                                                      setup.method != "full")  # fmt: skip
    return held and (not setup.precomputed_ref or setup.strategy == "fsdp")
