"""What a training process does first with the trainer the rehearsal built (role.py), done on probes: the trackers
report_to names, torch's GradScaler on a probe gradient, DeepSpeed's own reading of its config, each reward function
on one row, transformers' check of the attention the rehearsal swapped for SDPA, and DeepSpeed's libaio check before
NVMe offload. Each raises the owner's error."""

from __future__ import annotations

import inspect
import json
import re


def requested_attention(args: list[str]) -> str:
    """The attn_implementation of the training script's arguments, as TRL's parser takes it: the last
    `--attn_implementation`, else the `--config` file's (parsing them again would reset accelerate's state)."""
    from pathlib import Path

    from orchestrator.core.configs import load_yaml

    words = list(args)
    given = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--attn_implementation"]
    if given:
        return given[-1]
    config = words[words.index("--config") + 1] if "--config" in words[:-1] else None
    settings = load_yaml(Path(config), "TRL config") if config else {}
    return str((settings or {}).get("attn_implementation") or "sdpa")


def attention(name: str, model) -> None:
    """transformers' own check of the attn_implementation the nodes load (the rehearsal loads SDPA in its place): a
    name transformers has no attention function for (`foo`) or one the model class does not support. A Hub kernel is
    launch/kernelcheck.py's to check; flash attention's package is the nodes' (transformers falls back to the Hub's
    kernel there), so only its ImportError is left."""
    from transformers.integrations.hub_kernels import is_kernel

    base = name.split("|")[-1]  # paged|...: the same check on the attention it pages
    if is_kernel(base):
        return
    if version := re.fullmatch(r"flash_attention_(\d+)", base):
        try:
            model._flash_attn_can_dispatch(flash_attn_version=int(version.group(1)), is_init_check=True)
        except ImportError:
            pass  # flash-attn is not installed here
        return
    model.get_correct_attn_implementation(base, is_init_check=True)


def deepspeed_config(config: dict) -> None:
    """DeepSpeed's own reading of the finalized config, as `deepspeed.initialize` does in train() after the model loaded
    (its pydantic models refuse `offload_optimzer`, stage 4; the batch against the fake group's world size)."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)  # the fake group
    DeepSpeedConfig(json.loads(json.dumps(config)))


def async_io() -> None:
    """NVMe offload as it is (the head node): the model's load starts DeepSpeed's swapper, which loads the async_io op,
    and that load JIT-builds the pin_memory op (a C++ build: ~100 s of CPU on this 2-core machine) before it asks
    whether libaio is there (deepspeed/ops/op_builder/async_io.py AsyncIOBuilder.load, then jit_load). Asked first, with
    DeepSpeed's own check, a node without libaio gets DeepSpeed's own refusal (jit_load's: "Unable to JIT load the
    async_io op ...") in a second; a node with it goes on to the trainer, which builds both as its ranks will."""
    from deepspeed.ops.op_builder import AsyncIOBuilder  # the class the swapper loads, for this accelerator

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        builder.jit_load(verbose=False)  # raises before it builds anything: not compatible


def unscale(scaler, model) -> None:
    """What torch's GradScaler does with the trained parameters' gradients at the first step (accelerate's fp16
    under DDP or one process): it unscales them, and refuses fp16 ones ("Attempting to unscale FP16 gradients"), a
    model loaded with dtype=float16 and trained whole. One probe gradient per dtype the ranks would train in."""
    import torch

    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    probes = [torch.nn.Parameter(torch.zeros(1, dtype=dtype)) for dtype in sorted(dtypes, key=str)]
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    scaler._unscale_grads_(torch.optim.SGD(probes, lr=1.0), torch.ones(1), torch.zeros(1), False)


def trackers(training_args) -> None:
    """What the trainer's constructor does with report_to, without starting a tracker: transformers' own lookup of
    each name, then each callback's constructor, which refuses when its package is not installed (wandb, tensorboard,
    mlflow, ...: on the nodes, uv.lock's orch[train]). The rehearsal then builds the trainer with none."""
    from transformers.integrations import get_reporting_integration_callbacks

    for callback in get_reporting_integration_callbacks(training_args.report_to):
        callback()
    training_args.report_to = []


def call_rewards(trainer) -> dict[str, float | None]:
    """Every reward function of a generating trainer called on the first row of its dataset, with the arguments
    TRL's `_calculate_rewards` passes (prompts, completions, completion_ids, the row's other columns, trainer_state,
    log_extra, log_metric): a missing package (accuracy_reward's math_verify), a column the function reads and the
    data lacks, or an answer of the wrong length fails here, not at the first step. Reward models are loaded by the
    trainer already and not called. {name: the reward for one made-up completion}."""
    import torch

    row = next(iter(trainer.train_dataset))  # a streamed (iterable) dataset has no row 0 to index
    prompt = row["prompt"]
    completion = [{"role": "assistant", "content": "The answer is 4."}] if isinstance(prompt, list) else " 4"
    columns = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
    got = {}
    for func, name in zip(trainer.reward_funcs, trainer.reward_func_names, strict=True):
        if isinstance(func, torch.nn.Module):
            continue
        out = func(prompts=[prompt], completions=[completion], completion_ids=[[0]], trainer_state=trainer.state,
                   log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None, **columns)  # fmt: skip
        if inspect.iscoroutine(out):
            import asyncio

            out = asyncio.run(out)
        if not isinstance(out, list | tuple) or len(out) != 1:
            raise ValueError(f"reward function {name} returned {out!r} for 1 completion (TRL needs a list of 1)")
        got[name] = None if out[0] is None else float(out[0])
    return got
