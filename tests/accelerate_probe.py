"""Run in a process of its own by tests/test_cpu_strategies.py (accelerate's state is a process-wide singleton):
what accelerate makes of an FSDP2 or DeepSpeed launch on a CPU machine, printed as one `PROBE {json}` line.

  fsdp         an FSDP2 launch env, Accelerator(cpu=True): accelerate alone
  fsdp-helped  the same with orchestrator/train/cpu_fsdp.py installed
  ds           a DeepSpeed launch env, PartialState() as transformers builds it without ddp_backend (DeepSpeed's
               shared-memory op skipped, as orchestrator/train/cpu_deepspeed.py does in every CPU training process)
  ds-gloo      the same with backend="gloo" (TRL's --ddp_backend gloo)
"""

import json
import os
import sys

import torch

mode = sys.argv[1]

if mode.startswith("fsdp"):
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", ORCH_DEVICE="cpu")
    if mode == "fsdp-helped":
        from orchestrator.train import cpu_fsdp

        cpu_fsdp.install()
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, _ = acc.prepare(net, torch.optim.AdamW(net.parameters()))
    from torch.distributed.tensor import DTensor

    out = {
        "distributed_type": acc.distributed_type.value,
        "num_processes": acc.num_processes,
        "dtensor": sum(isinstance(p, DTensor) for p in model.parameters()),
    }
else:
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ORCH_DEVICE="cpu")
    from orchestrator.train import cpu_deepspeed

    cpu_deepspeed.skip_shm_comm()  # as the training entry does: no C++ build of DeepSpeed's shared-memory op
    from accelerate.state import PartialState

    state = PartialState(backend="gloo") if mode == "ds-gloo" else PartialState()
    import deepspeed.comm as dc

    out = {
        "distributed_type": state.distributed_type.value,
        "num_processes": state.num_processes,
        "deepspeed_world_size": dc.get_world_size(),
        "shm_comm": cpu_deepspeed.shm_comm_built(),
    }
print("PROBE " + json.dumps(out), flush=True)
