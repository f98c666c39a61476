"""TRL's fused LM head (trl/kernels/chunked_logprob.py), run on CPU under a count of live tensor bytes, against the
memory model's term for it (core/memory.lm_head).

Every trainer orch runs but the reward model scores tokens through this head, so the tokens x vocabulary logits never
exist whole: the head's peak is one tile, the hidden states' gradient and, when the head is trained, its weight's
gradient. On CPU the tile is folded by torch ops with temporaries of their own (a GPU folds it in place with Triton),
which are freed before the backward's end, where the peak the model counts lies: with a tile small beside the
gradients, the CPU's peak is the GPU's. TRL's tile (4096 tokens x 32768 vocabulary columns) is scaled down so each
case takes a fraction of a second; the first test pins the model's tile to TRL's.
"""

import weakref

import pytest

from orchestrator.core import memory

pytestmark = pytest.mark.e2e

TILE = (128, 512)  # tokens x vocabulary columns, for the measurements


def test_the_models_tile_is_trls():
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    assert memory.HEAD_TILE == (chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE)


def _peak_bytes(monkeypatch, tokens: int, vocab: int, hidden: int, trained: bool, autocast: bool) -> int:
    """The most bytes that tensors made by TRL's fused head's forward and backward held at once (storages counted
    once, however many views share them; freed when their last view goes)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from trl.kernels import chunked_logprob

    class LiveBytes(TorchDispatchMode):
        def __init__(self, inputs):
            super().__init__()
            self.live = self.peak = 0
            self.held = {id(t.untyped_storage()) for t in inputs}  # the caller's tensors are not the head's

        def _freed(self, key, size):
            self.held.discard(key)
            self.live -= size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()  # one Python object per storage, alive as long as the storage
                    if id(storage) not in self.held:
                        self.held.add(id(storage))
                        self.live += storage.nbytes()
                        weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
            self.peak = max(self.peak, self.live)
            return out

    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", TILE[0])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if autocast else torch.float32
    hidden_states = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=trained)
    labels = torch.randint(0, vocab, (tokens,))
    with LiveBytes([hidden_states, weight, labels]) as count:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            log_probs, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
                hidden_states, weight, None, labels, 1.0, TILE[1], None, 1.0, ("log_probs", "entropy", "is_top1")
            )
        log_probs.sum().backward()
    return count.peak


@pytest.mark.parametrize(
    "tokens, vocab, hidden, trained, autocast",
    [
        (2048, 8192, 1024, True, True),  # full fine-tuning in bf16: the head's fp32 gradient and its bf16 copy
        (2048, 8192, 1024, False, True),  # LoRA: the head is frozen, only the hidden states get a gradient
        (2048, 16384, 1024, False, True),  # twice the vocabulary, frozen head: the same peak (the tile bounds it)
        (4096, 8192, 1024, False, True),  # twice the tokens: only the hidden states' gradient grows
        (100, 8192, 1024, True, True),  # fewer tokens than a tile's rows
        (2048, 8192, 1024, True, False),  # fp32 without autocast: the gradients are not copied again
    ],
)
def test_trls_fused_head_holds_what_the_memory_model_counts(monkeypatch, tokens, vocab, hidden, trained, autocast):
    measured = _peak_bytes(monkeypatch, tokens, vocab, hidden, trained, autocast)
    compute = 2 if autocast else 4
    parts = memory.lm_head(tokens, vocab, hidden, trained=trained, compute=compute, tile=TILE)
    # the scored hidden states' copy is made by the caller (add_fused_lm_head), before the function measured here
    counted = sum(parts.values()) - tokens * hidden * compute
    # left out by the model: the per-token fp32 statistics (log-sum-exp, entropy, ...), and the CPU's fold temporaries
    # (a few fp32 tiles), which make the peak only where the gradients are not copied at the end (fp32)
    left_out = tokens * 4 * 12 + 8 * TILE[0] * TILE[1] * 4
    assert counted <= measured <= counted + left_out, (measured, counted, parts)
