"""The optimizer states a trained parameter keeps, by transformers' `optim` name (no torch import): the memory model's
optimizer term (core/memory.py) for every optim the nodes' environment can build."""

from __future__ import annotations

# transformers' optim names -> (states a trained parameter keeps, bytes each: 0 for the parameter's dtype, as torch's
# optimizers keep them; bitsandbytes' 8-bit ones a byte and an fp32 absmax per 256 (and a 1 KiB map a tensor), its
# 32-bit ones fp32 whatever the parameter's dtype). Read back from each optimizer's state after a step on CPU:
# tests/test_optim_memory.py. Adafactor keeps factored row and column statistics (a few bytes a row), SGD without
# momentum nothing. Another name (an optimizer of a package the nodes do not install: the rehearsal refuses it) is
# counted as AdamW.
OPTIM_STATES: dict[str, tuple[int, float]] = {
    "adamw_torch": (2, 0), "adamw_torch_fused": (2, 0), "ademamix": (3, 4), "adagrad": (1, 0), "rmsprop": (1, 0),
    "sgd": (0, 0), "adafactor": (0, 0),
    **{name: (2, 1 + 1 / 64) for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")},
    **{name: (3, 1 + 1 / 64) for name in ("ademamix_8bit", "paged_ademamix_8bit")},
    **{name: (1, 1 + 1 / 64) for name in ("lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit")},
    "paged_adamw_32bit": (2, 4), "paged_ademamix_32bit": (3, 4),
    **{name: (1, 4) for name in ("lion_32bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_bnb_32bit")},
}  # fmt: skip
DEFAULT_OPTIM = "adamw_torch"


def optim_bytes(optim: str, param_bytes: float) -> float:
    """Bytes of optimizer state a trained parameter of `param_bytes` keeps under transformers' `optim`."""
    moments, each = OPTIM_STATES.get(optim, OPTIM_STATES[DEFAULT_OPTIM])
    return moments * (each or param_bytes)
