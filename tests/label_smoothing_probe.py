"""transformers' LabelSmoother, which TRL 1.16's SFTTrainer takes the loss from when label_smoothing_factor > 0, over
the logits of an LM head, forward and backward on CPU, and the most bytes its tensors held at once:
`python tests/label_smoothing_probe.py '<json cases>'` prints a JSON list of peaks. A process of its own (autograd;
tests/lm_head_probe.py says why). Used by tests/test_label_smoothing_memory.py.

CUDA's autocast runs log_softmax in fp32 (torch's "CUDA ops that can autocast to float32"); CPU's leaves it in bf16.
The `cuda` regime casts log_softmax's input to fp32 as CUDA's autocast does; everything else is the owners' code."""

import json
import sys

import torch
import transformers.trainer_pt_utils as trainer_pt_utils
from lm_head_probe import LiveBytes

log_softmax = torch.nn.functional.log_softmax


def as_cuda_autocast(x, dim=None, **kwargs):
    return log_softmax(x.float(), dim) if torch.is_autocast_enabled("cpu") else log_softmax(x, dim, **kwargs)


def peak(tokens: int, vocab: int, hidden: int, regime: str) -> int:
    """regime: `cuda` (bf16 autocast as on a GPU), `fp32` (no autocast), `bf16` (bf16 weights, no autocast)."""
    trainer_pt_utils.nn.functional.log_softmax = as_cuda_autocast if regime == "cuda" else log_softmax
    dtype = torch.float32 if regime == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    states = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=dtype)
    labels = torch.randint(0, vocab, (1, tokens))
    with LiveBytes([states, weight, labels]) as count:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "cuda"):
            logits = torch.nn.functional.linear(states, weight)
            loss = trainer_pt_utils.LabelSmoother(epsilon=0.1)({"logits": logits}, labels, shift_labels=True)
        del logits
        loss.backward()
    return count.peak


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([peak(**case) for case in json.loads(sys.argv[1])]))
