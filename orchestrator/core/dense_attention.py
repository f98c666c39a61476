"""The seq x seq tensors attention holds where it is not flash-attention: memory.py's per-token terms leave them out,
and they grow with the square of the sequence. Read from the owners' code and measured on CPU with transformers'
models (tests/test_dense_attention_memory.py):

- sdpa: transformers 5 (masking_utils.sdpa_mask) builds a boolean mask of rows x 1 x seq x seq, one byte an entry,
  once a forward, wherever a batch holds padding (a padded batch: DPO's pairs, SFT without packing, GRPO's prompts) or
  packed sequences (SFT's padding-free rows, from position_ids): a batch with neither takes SDPA's is_causal instead.
  torch's scaled_dot_product_attention converts it to an additive bias in the compute dtype at every call
  (convert_boolean_attn_mask, before it picks a kernel), and the kernel keeps that bias for its backward: every layer's
  while training, one layer's with gradient checkpointing. Context parallelism (accelerate's hooks, kept for
  evaluation too) and Ulysses (DeepSpeed's wrapper) drop the mask at the attention: the model still builds it.
- eager: the mask always, as a bias in the compute dtype, and every head's scores: each layer keeps the fp32 softmax
  and its cast for its backward; the layer at work holds the scores, their fp32 copy and the softmax at once.
- flash-attention, kernels from the Hub, flex attention: none of these (a padding mask at most).
"""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core import trainers
from orchestrator.core.overrides import truthy

DENSE = ("sdpa", "eager")
"""The attention implementations that hold seq x seq tensors (transformers' default, when none is named, is sdpa)."""
PART = {"sdpa": "attention mask", "eager": "attention scores"}
NAMED = (*DENSE, "flash_attention_2", "flash_attention_3", "flex_attention")
"""transformers' own attention names; a Kernels Hub kernel is named org/name."""


def kind(attention: str | None) -> str:
    """The Setup's dense_attention for an attn_implementation: "sdpa", "eager", or "" for one that holds none."""
    name = attention or "sdpa"
    return name if name in DENSE else ""


def batch_shape(trainer: str, settings: Mapping[str, object]) -> str:
    """How a micro-batch reaches the model: "flattened" (one row of every sequence, padding-free: TRL's collator with
    padding_free, or packing's bfd strategies), "full" (rows all max_length long: wrapped packing pads nothing) or
    "padded" (each row padded to the longest)."""
    if not trainers.spec(trainer).padding_free:
        return "padded"
    packing = truthy(settings.get("packing", False))
    if truthy(settings.get("padding_free", False)) or packing and str(settings.get("packing_strategy") or "bfd") != \
            "wrapped":  # fmt: skip
        return "flattened"
    return "full" if packing else "padded"


def mask_entries(rows: int, length: int, shape: str) -> int:
    """Entries of the mask for `rows` sequences of `length` tokens: one row of them all when flattened."""
    return (rows * length) ** 2 if shape == "flattened" else rows * length**2


def _eager(entries: int, heads: int, compute: int) -> tuple[int, int]:
    """(bytes a layer keeps for backward, bytes the layer at work holds) of eager attention's scores."""
    kept = 4 + (compute if compute < 4 else 0)  # the fp32 softmax, and its cast to the compute dtype
    working = compute + 4 + (4 if compute < 4 else 0)  # the scores, their fp32 copy, the fp32 softmax
    return entries * heads * kept, entries * heads * working


def training(setup, compute: int) -> float:
    """Bytes per GPU a training step holds in seq x seq tensors (`setup`: a memory.Setup)."""
    if not setup.dense_attention:
        return 0.0
    rows = setup.micro_batch * trainers.spec(setup.trainer).rows_per_sample
    entries = mask_entries(rows, setup.seq_len // setup.seq_split, setup.batch_shape)
    layers = 1 if setup.checkpointing else setup.arch.layers
    if setup.dense_attention == "eager":
        kept, working = _eager(entries, setup.arch.heads, compute)
        return compute * entries + kept * (layers - 1) + working + 2 * entries * setup.arch.heads
    if setup.batch_shape == "full":
        return 0.0
    return entries * (1 + (0 if setup.seq_split > 1 else compute * layers))


def evaluation(setup, compute: int) -> tuple[float, float]:
    """(bytes held through an evaluation forward, bytes more while a layer attends): no sequence is split there."""
    if not setup.dense_attention:
        return 0.0, 0.0
    rows = setup.eval_batch * trainers.spec(setup.trainer).rows_per_sample
    entries = mask_entries(rows, setup.seq_len, setup.batch_shape)
    if setup.dense_attention == "eager":
        return compute * entries, _eager(entries, setup.arch.heads, compute)[1]
    if setup.batch_shape == "full":
        return 0.0, 0.0
    return entries, 0.0 if setup.seq_split > 1 else compute * entries
