"""The one piece of help accelerate needs for FSDP2 on CPU (smoke runs): the rest is the owners' code.

torch's FSDP2 (`fully_shard`) trains on CPU over gloo: DTensor parameters, sharded optimizer states, distributed
checkpoints and full state dicts all work there. accelerate does not let it: `AcceleratorState.__init__` turns
`ACCELERATE_USE_FSDP` / an FSDP plugin into `DistributedType.FSDP` only inside its branch for GPU-like distributed
types (MULTI_GPU, MULTI_XPU, ...). A CPU process (TRL's `use_cpu`) is MULTI_CPU and keeps the plugin unused, so every
rank trains plain DDP while the config says FSDP. `install()` wraps that constructor: when accelerate left a MULTI_CPU
state with an FSDP plugin in hand, it finishes the job the GPU branch would have done (distributed type FSDP, the
plugin stored, its mixed precision set). Nothing else is changed: accelerate's own `fsdp2_prepare_model`,
checkpointing and state-dict code run as on GPUs.

DeepSpeed needs no help: its bookkeeping mismatch on CPU ("train_batch_size ... 4 != 4 * 1 * 2") comes from
accelerate's PartialState, which finds no backend without a GPU, so it calls the run "no distributed training" with
one process while DeepSpeed's own comm initialised gloo with the real world size. TRL's `--ddp_backend gloo` (a
TrainingArguments field) gives PartialState the backend, and both agree; orch passes it (orchestrator/node/launcher.py).

tests/test_cpu_strategies.py fails loudly if a new accelerate changes either behaviour: if it stops needing this
(MULTI_CPU becomes FSDP on its own) or if the wrap no longer produces an FSDP state.
"""

from __future__ import annotations

import functools
import os

from orchestrator.core.knobs import knob

_INSTALLED = "_orch_cpu_fsdp"


def wanted(env=os.environ) -> bool:
    """A CPU process (orch's ORCH_DEVICE=cpu) that accelerate launched with an FSDP config."""
    return knob(env, "ORCH_DEVICE") == "cpu" and env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def install() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, _INSTALLED, False):
        return

    @functools.wraps(original)
    def __init__(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None, fsdp_plugin=None,
                 *args, **kwargs):  # fmt: skip
        original(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    setattr(__init__, _INSTALLED, True)
    AcceleratorState.__init__ = __init__
