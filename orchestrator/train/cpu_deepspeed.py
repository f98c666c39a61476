"""DeepSpeed on CPU without compiling an op that training never calls (smoke runs, `orch run --local`).

When DeepSpeed's comm starts on its CPU accelerator, `TorchBackend.__init__` JIT-builds the shared-memory
collectives (`deepspeed_shm_comm`, csrc/cpu/comm): a C++ compile against torch's headers that needs a compiler and
ninja, took 45-65 s here, and is redone whenever the environment's path changes (each fresh clone, each venv). Its
one user is `inference_all_reduce` (AutoTP inference layers), which falls back to torch.distributed's all_reduce
without it; ZeRO's collectives are torch.distributed's. A CUDA node never builds it (the CUDA accelerator has no such
builder), so leaving it out also keeps the CPU run closer to the GPU one.

The switch is DeepSpeed's own: `build_shm_op` builds only ops marked compatible in `deepspeed.ops.__compatible_ops__`,
a dict DeepSpeed keeps as one object so that edits to it persist (its comment). CPU Adam (ZeRO offload) is another
op and still builds when a recipe offloads. The rank report reads back whether the live comm backend holds the op
(`train/ran.strategy_facts`: shm_comm).
"""

from __future__ import annotations

import os

from orchestrator.core.knobs import knob

SHM_COMM = "deepspeed_shm_comm"


def wanted(env=os.environ) -> bool:
    """A CPU process (orch's ORCH_DEVICE=cpu) that accelerate launched with a DeepSpeed config."""
    return knob(env, "ORCH_DEVICE") == "cpu" and env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def skip_shm_comm() -> None:
    """Before DeepSpeed's comm starts (TrainingArguments sets it up): mark the shared-memory op incompatible."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM] = False


def shm_comm_built() -> bool:
    """Whether the running comm backend holds the shared-memory op (False after skip_shm_comm)."""
    from deepspeed.comm import comm

    return getattr(comm.cdb, "shm_comm_op", None) is not None
