"""Run by tests/test_ds_bucket.py: DeepSpeed's engines on CPU, for the config accelerate builds from an Accelerate
config's deepspeed_config (its DeepSpeedPlugin, as accelerate launch's ranks do), with what the Trainer fills in for
its "auto" values.

- `python tests/ds_bucket.py bucket PORT` (one process): the gradient bucket read from the optimizer, for stages 1
  to 3; prints `BUCKET <stage> <bytes at the end of initialize> <bytes during backward>`; then for ZeRO-2 from a
  DeepSpeed JSON whose reduce_bucket_size is "auto" (transformers fills it from the model's hidden_size) or a number,
  and for overlap_comm and contiguous_gradients: `JSONBUCKET <its zero_optimization> <hidden_size> <bytes during
  backward>`.
- `python -m torch.distributed.run --nproc_per_node 2 tests/ds_bucket.py prepared`: the bytes ZeRO-3's initialize
  adds on each rank (every tensor storage alive after it and not before, the bucket included) for a full fine-tune
  of a bf16 model; prints `PREPARED <rank> <params> <bytes>`."""

import gc
import json
import os
import sys

os.environ["DS_ACCELERATOR"] = "cpu"
if sys.argv[1] == "bucket":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from orchestrator.train import cpu_deepspeed  # noqa: E402

cpu_deepspeed.skip_shm_comm()  # as the training entry does: no C++ build of DeepSpeed's shared-memory op (~1 min)


def engine(stage: int, model: torch.nn.Module, json: dict | None = None):
    """`json`: a DeepSpeed JSON's settings, as accelerate's plugin takes a deepspeed_config_file, with its hidden-size
    "auto" values filled as transformers' HfTrainerDeepSpeedConfig fills them from the model's config."""
    if json is None:
        config = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1).deepspeed_config
        assert "reduce_bucket_size" not in config.get("zero_optimization", {}), config  # DeepSpeed's default applies
    else:
        import tempfile
        from types import SimpleNamespace

        from transformers import TrainingArguments
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        config = DeepSpeedPlugin(hf_ds_config=json).deepspeed_config
        hf = HfTrainerDeepSpeedConfig(config)
        model.config = SimpleNamespace(hidden_size=model[0].in_features)
        with tempfile.TemporaryDirectory() as out:
            hf.trainer_config_finalize(TrainingArguments(out, use_cpu=True, report_to=[]), model, 1)
        config = hf.config
    # what the Trainer fills in for accelerate's "auto" values (batch sizes, max_grad_norm) with bf16
    world = int(os.environ["WORLD_SIZE"])
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=world, gradient_clipping=1.0,
                  bf16={"enabled": True})  # fmt: skip
    built, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    return built


def backward_peak(ds) -> int:
    """The bucket's bytes at its fullest during one backward (and the step after it)."""
    during: list[int] = []
    for param in ds.module.parameters():
        param.register_hook(lambda grad, during=during, optimizer=ds.optimizer: during.append(held(optimizer)))
    ds.backward(ds(torch.randn(1, ds.module[0].in_features, dtype=torch.bfloat16)).float().sum())
    ds.step()
    return max(during)


def held(optimizer) -> int:
    total = 0
    for bucket in optimizer.ipg_buckets.values():
        buffers = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
        total += sum(t.numel() * t.element_size() for t in buffers if t is not None)
    return total


def storages() -> dict[int, int]:
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


if sys.argv[1] == "bucket":
    for stage in (1, 2, 3):
        ds = engine(stage, torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
        at_init = held(ds.optimizer)
        print(f"BUCKET {stage} {at_init} {backward_peak(ds)}", flush=True)
        ds.destroy()
    for given, stage, zero in (("auto", 2, {}), (3000, 2, {}), (3000, 1, {"overlap_comm": True}),
                               (3000, 2, {"overlap_comm": True}), (3000, 3, {"overlap_comm": True}),
                               (3000, 2, {"contiguous_gradients": False}), (3000, 3, {"contiguous_gradients": False})):
        model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 8))
        settings = {"stage": stage, "reduce_bucket_size": given, **zero}
        ds = engine(stage, model, {"zero_optimization": settings})
        print(f"JSONBUCKET {json.dumps(settings)} 96 {backward_peak(ds)}", flush=True)
        ds.destroy()
else:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    before = storages()
    ds = engine(3, model)
    gc.collect()
    added = sum(size for ptr, size in storages().items() if ptr not in before)
    print(f"PREPARED {os.environ['RANK']} {params} {added}", flush=True)
