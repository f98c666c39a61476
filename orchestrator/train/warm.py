"""`python -m orchestrator.train.warm TRAINER`: import what a training process and its launcher import, so that this
environment keeps their bytecode (run by `orch node --rehearse` in a node's setup, orchestrator/node/warm.py).

uv installs packages without compiling them (its default), so the first process to import TRL, transformers, peft,
datasets and DeepSpeed on a new node compiles them. On the head node that is the setup's rehearsal; on the other
nodes it was their training processes, between the launch and step 1, and the slowest node sets when every rank
starts (measured on 2 cores: a rank's launch and model load 8.9 s cold, 5.5 s after this; 12.7 s with torch cold).
The list follows what a rank imports (train/entry.py, TRL's script and trainer class, accelerate's launcher and
torchrun's agent, FSDP2 and DCP); accelerate imports DeepSpeed on every model unwrap where it is installed
(accelerate/utils/other.py, extract_model_from_parallel), so it is here too. The model's own modeling module is not:
its config may still be downloading.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time


def main(argv: list[str]) -> int:
    from orchestrator.core import trainers

    if len(argv) != 1 or argv[0] not in trainers.SPECS:
        print(f"usage: python -m orchestrator.train.warm {{{','.join(trainers.TRAINERS)}}}", file=sys.stderr)
        return 2
    started = time.monotonic()
    import accelerate.commands.launch  # noqa: F401  the launcher: python -m accelerate.commands.launch
    import torch.distributed.checkpoint  # noqa: F401  checkpoints (DCP)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.run  # noqa: F401  the launcher's agent on more than one machine

    from orchestrator.train import entry

    importlib.import_module(f"trl.scripts.{argv[0]}").make_parser()
    entry.trainer_class(argv[0])
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed import DeepSpeedEngine  # noqa: F401  as accelerate imports it
    print(f"ORCH_WARM {len(sys.modules)} {time.monotonic() - started:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
