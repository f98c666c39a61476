"""Run by tests/test_ds_bucket.py in its own process: DeepSpeed's gradient bucket, read from its optimizer, for the
config accelerate builds from an Accelerate config's deepspeed_config (its DeepSpeedPlugin, as accelerate launch's
ranks do). Prints `BUCKET <stage> <bytes at the end of initialize> <bytes during backward>` for stages 1 to 3."""

import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")  # fmt: skip

import deepspeed  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402


def held(optimizer) -> int:
    total = 0
    for bucket in optimizer.ipg_buckets.values():
        buffers = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
        total += sum(t.numel() * t.element_size() for t in buffers if t is not None)
    return total


for stage in (1, 2, 3):
    config = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1).deepspeed_config
    # what the Trainer fills in for accelerate's "auto" values (batch sizes, max_grad_norm) with bf16
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=1, gradient_clipping=1.0, bf16={"enabled": True})
    assert "reduce_bucket_size" not in config.get("zero_optimization", {}), config  # DeepSpeed's default applies
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    at_init = held(engine.optimizer)
    during: list[int] = []
    for param in engine.module.parameters():
        param.register_hook(lambda grad, during=during, optimizer=engine.optimizer: during.append(held(optimizer)))
    engine.backward(engine(torch.randn(1, 64, dtype=torch.bfloat16)).float().sum())
    engine.step()
    print(f"BUCKET {stage} {at_init} {max(during)}", flush=True)
    engine.destroy()
