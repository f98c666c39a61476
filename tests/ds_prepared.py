"""Run by tests/test_ds_bucket.py under torch.distributed.run (2 processes): the bytes ZeRO-3's initialize adds on each
rank (every tensor storage alive after it and not before, the gradient bucket included) for a full fine-tune of a bf16
model, with the config accelerate's DeepSpeedPlugin makes. Prints `PREPARED <rank> <params> <bytes>`."""

import gc
import os

os.environ["DS_ACCELERATOR"] = "cpu"

import deepspeed  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402


def storages() -> dict[int, int]:
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


config = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1).deepspeed_config
world = int(os.environ["WORLD_SIZE"])
config.update(train_micro_batch_size_per_gpu=1, train_batch_size=world, gradient_clipping=1.0, bf16={"enabled": True})
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(torch.bfloat16)
params = sum(p.numel() for p in model.parameters())
gc.collect()
before = storages()
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
gc.collect()
added = sum(size for ptr, size in storages().items() if ptr not in before)
print(f"PREPARED {os.environ['RANK']} {params} {added}", flush=True)
