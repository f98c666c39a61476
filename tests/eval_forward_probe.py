"""An evaluation's forward on CPU, as TRL's trainers run it (no gradients, the fused LM head), and the most bytes its
tensors held at once: `peaks` gives [backbone, whole], the decoder layers alone and with TRL's head after them;
`python tests/eval_forward_probe.py '<json cases>'` prints a JSON list of them. Used by tests/test_eval_memory.py.

Attention runs as flash-attention does on a GPU, in memory: its output and its fp32 log-sum-exp, no seq x seq
scores (CPU's SDPA math path would materialise them, which a GPU's flash or memory-efficient kernel never does); its
values do not matter to a count of bytes. Everything else is transformers' own modelling code."""

import json
import sys

import torch
import transformers
from lm_head_probe import LiveBytes
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from trl.kernels import chunked_logprob
from trl.trainer import utils


def flash_like(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    batch, heads, length, dim = query.shape
    torch.empty(batch, heads, length, dtype=torch.float32)  # the softmax log-sum-exp flash-attention keeps
    return torch.empty(batch, length, heads, dim, dtype=query.dtype), None


AttentionInterface.register("probe_attention", flash_like)
AttentionMaskInterface.register("probe_attention", flash_attention_mask)  # a padding mask at most, as flash takes


def peaks(family: str, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, batch: int,
          length: int, dtype: str, vocab: int, tile: list[int]) -> list[int]:  # fmt: skip
    # TRL's tile, scaled down for the measure and TRL's own again after it: test_eval_memory.py calls this in a pytest
    # worker, whose later tests (the trainers' runs there, test_lm_head_memory.py's pin of TRL's tile) read TRL's
    kept = chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE
    chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE = tile
    try:
        return _peaks(family, hidden, intermediate, heads, kv_heads, head_dim, batch, length, dtype, vocab)
    finally:
        chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE = kept


def _peaks(family: str, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, batch: int,
           length: int, dtype: str, vocab: int) -> list[int]:  # fmt: skip
    config = getattr(transformers, f"{family}Config")(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=length,
        attn_implementation="probe_attention", pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(getattr(torch, dtype)).eval()
    utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # SFT's metrics, as its trainer asks
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.ones_like(ids)
    held = [ids, mask, *model.parameters(), *model.buffers()]
    out = []
    with torch.no_grad():
        with LiveBytes(held) as count:
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        out.append(count.peak)
        with LiveBytes(held) as count:
            model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
        out.append(count.peak)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([peaks(**case) for case in json.loads(sys.argv[1])]))
