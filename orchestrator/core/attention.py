"""Which attention a recipe's ranks load the model with, read from its TRL settings as train/entry.build reads them,
and whether that may be a Kernels Hub kernel: pure names, for the node's prefetch (train/attention_kernel.py) and
the launch side's check (launch/kernelcheck.py) alike."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping

from orchestrator.core.overrides import truthy

FLASH = re.compile(r"flash_attention_\d")
FLASH_KERNEL = "kernels-community/flash-attn2"
"""The flash-attention the recipes load from the Kernels Hub (the nodes' gpu extra installs its client)."""
TRUST_FIX = 'set model_init_kwargs={"allow_all_kernels": true} if you trust its code, or another attn_implementation'
"""The recipe's fix for a kernel from a publisher the Hub does not trust (the ranks then load it: train/entry.build)."""


def requested(settings: Mapping) -> tuple[str | None, bool]:
    """(the attn_implementation the ranks load the model with, allow_all_kernels), from the TRL settings: a key of
    model_init_kwargs wins over the top-level attn_implementation, as in train/entry.build."""
    kwargs = settings.get("model_init_kwargs") or {}
    if isinstance(kwargs, str):  # a key=value override: TRL parses the JSON text
        with contextlib.suppress(ValueError):
            kwargs = json.loads(kwargs)
    kwargs = kwargs if isinstance(kwargs, Mapping) else {}
    attention = kwargs.get("attn_implementation") or settings.get("attn_implementation")
    name = str(attention).split("|")[-1].strip() if attention else None  # paged|...: inference only
    return name, truthy(kwargs.get("allow_all_kernels", False))


def may_need_hub(attention: str | None) -> bool:
    """Whether `attention` may load a Hub kernel (decided without importing transformers: sdpa, eager... never do)."""
    return attention is not None and ("/" in attention or FLASH.fullmatch(attention) is not None)
