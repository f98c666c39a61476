"""Which launches use bitsandbytes, and running the rest without it, as their nodes do.

The nodes install bitsandbytes with orch's quant extra only (QLoRA recipes, bitsandbytes optimizers). Where it is
installed anyway (this project's dev environment, a user's laptop with `.[quant]`), importing PEFT imports it
(peft/helpers.py: `try: import bitsandbytes`), and bitsandbytes 0.50 wraps its CPU kernels in `torch.compile` at
import (bitsandbytes/backends/default/ops.py), which imports torch._dynamo and torch._inductor: about 1 s of CPU per
process here, in the rehearsal and in every rank of a smoke run. A process that does not use it hides it instead
(`hide`): `sys.modules["bitsandbytes"] = None` makes `import bitsandbytes` raise ImportError and
`importlib.util.find_spec` return None (CPython's importlib.util.find_spec), which is what PEFT's and transformers'
availability checks call, so such a process sees what a node without the quant extra has.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from orchestrator.core.overrides import truthy

# transformers 5.17's bitsandbytes optimizers (trainer_optimizer._BITSANDBYTES_OPTIMIZERS; a test compares them)
OPTIMIZERS = (
    "adamw_bnb_8bit adamw_8bit paged_adamw_32bit paged_adamw_8bit ademamix ademamix_8bit paged_ademamix_32bit "
    "paged_ademamix_8bit lion_32bit lion_8bit paged_lion_32bit paged_lion_8bit rmsprop_bnb rmsprop_bnb_8bit "
    "rmsprop_bnb_32bit"
).split()
LOADING = ("load_in_4bit", "load_in_8bit")  # TRL's ModelConfig: get_quantization_config's BitsAndBytesConfig
ENV = "ORCH_BITSANDBYTES"
"""`off` in a smoke run's ranks whose settings use no bitsandbytes (their model is orch's tiny one, never a
pre-quantised checkpoint, whose config.json would ask for it without any setting)."""


def uses(setting: Callable[[str, object], object]) -> bool:
    """Whether the TRL settings (`setting(key, default)`, as Launch.setting) load in 4 or 8 bits or use a bitsandbytes
    optimizer."""
    if any(truthy(setting(key, False)) for key in LOADING):
        return True
    optim = setting("optim", "")
    words = [str(v) for v in optim] if isinstance(optim, list | tuple) else str(optim).split()
    return any(word.lower() in OPTIMIZERS for word in words)


def hide() -> None:
    """This process runs as if bitsandbytes were not installed (before anything imports it)."""
    sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]  # None: the import system's "absent"
