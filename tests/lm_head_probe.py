"""TRL's fused LM head (trl/kernels/chunked_logprob.ChunkedLogProbFunction), one forward and backward per case on
CPU, and the most bytes its tensors held at once: `python tests/lm_head_probe.py '<json cases>'` prints a JSON list
of peaks. A process of its own, so that nothing another test left in the interpreter (a tracer holding a frame, and
with it a gradient autograd would then copy) changes the count. Used by tests/test_lm_head_memory.py."""

import json
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from trl.kernels import chunked_logprob


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made by the operators run under it (each counted once, however many views share it;
    freed when its last view goes: a storage's Python object lives as long as the storage)."""

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
                storage = t.untyped_storage()
                if id(storage) not in self.held:
                    self.held.add(id(storage))
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def peak(tokens: int, vocab: int, hidden: int, trained: bool, autocast: bool, tile: list[int]) -> int:
    chunked_logprob.TOKEN_CHUNK_SIZE = tile[0]  # TRL's tile scaled down; the vocabulary side is an argument
    torch.manual_seed(0)
    dtype = torch.bfloat16 if autocast else torch.float32
    hidden_states = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=trained)
    labels = torch.randint(0, vocab, (tokens,))
    with LiveBytes([hidden_states, weight, labels]) as count:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            log_probs, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
                hidden_states, weight, None, labels, 1.0, tile[1], None, 1.0, ("log_probs", "entropy", "is_top1")
            )
        log_probs.sum().backward()
    return count.peak


if __name__ == "__main__":
    torch.set_num_threads(1)  # the peaks do not depend on it; a loaded machine's two cores shared by two threads do
    print(json.dumps([peak(**case) for case in json.loads(sys.argv[1])]))
