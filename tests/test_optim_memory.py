"""The optimizer term of the memory model by TRL's `optim` (core/optimizers.py): it counted AdamW's two moments for
every optim, so a run that chose an 8-bit optimizer (or Adafactor, or SGD) to fit was refused as not fitting, and
`orch plan` could not say what one saves. Each optimizer's states are read back after a step on CPU, built as
transformers' Trainer builds it from the name (bitsandbytes' included)."""

import pytest

from orchestrator.core import accelerate_config, fit, memory, models, optimizers


def measured(name: str, dtype) -> float:
    """Bytes of optimizer state a parameter keeps after one step: transformers' lookup, torch's or bitsandbytes' own."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(out, optim=name, use_cpu=True,
                                                                             report_to=[]))  # fmt: skip
    # bitsandbytes pages a state of 1e5 elements or more into CUDA's managed memory, which a CPU build has not
    size = 256 if name.startswith("paged_") else 1024
    layer = torch.nn.Linear(size, size, bias=False).to(dtype)
    optimizer = cls(layer.parameters(), **kwargs)
    layer.weight.grad = torch.randn_like(layer.weight)
    optimizer.step()
    # not a step count (a 0-d tensor) nor bitsandbytes' quantisation maps (qmap1, qmap2: 1 KiB a tensor, whatever
    # its size, nothing a parameter of a model's tensors keeps)
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for key, t in state.items()
               if torch.is_tensor(t) and t.dim() > 0 and not str(key).startswith("qmap"))  # fmt: skip
    return held / layer.weight.numel()


@pytest.mark.e2e  # imports transformers, torch and bitsandbytes (seconds)
def test_each_optims_states_are_what_the_optimizer_keeps():
    import torch
    from transformers.training_args import OptimizerNames

    for name in optimizers.OPTIM_STATES:
        for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
            kept, modelled = measured(name, dtype), optimizers.optim_bytes(name, size)
            # (Adafactor's factored statistics: a row and a column, 0.008 bytes a parameter of a 1024 x 1024 tensor)
            assert kept == pytest.approx(modelled, rel=0.01, abs=0.01), (name, dtype, kept, modelled)
    # every other optim transformers names needs a package the nodes' environment does not hold (GaLore, LOMO,
    # torchao, ...): a new one that builds here is modelled, not counted as AdamW unseen
    for name in sorted({o.value for o in OptimizerNames} - set(optimizers.OPTIM_STATES)):
        with pytest.raises((ImportError, ValueError)):
            measured(name, torch.float32)


@pytest.mark.unit
def test_the_launch_plans_the_optimizer_the_trl_config_names():
    arch = models.KNOWN_ARCHS["meta-llama/llama-3.1-8b-instruct"]
    gib = arch.params / 2**30

    def optimizer_gib(strategy, **kw):
        return memory.estimate(memory.Setup(arch, strategy=strategy, gpus=8, **kw)).parts["optimizer"]

    assert optimizer_gib("ddp", optim="adamw_8bit") == pytest.approx(2 * (1 + 1 / 64) * gib)  # bf16 weights, 8-bit m, v
    assert optimizer_gib("ddp", optim="paged_adamw_32bit") == pytest.approx(8 * gib)  # fp32 whatever the weights
    assert optimizer_gib("ddp") == pytest.approx(4 * gib)  # torch's AdamW: the parameters' dtype
    assert optimizer_gib("fsdp", optim="sgd") == 0  # accelerate's fp32 upcast, no momentum
    assert optimizer_gib("zero3", optim="adafactor") == pytest.approx(4 * gib / 8)  # DeepSpeed's fp32 master remains
    assert optimizer_gib("zero2", optim="lion_8bit") == pytest.approx((4 + 1 + 1 / 64) * gib / 8)
    settings = {"model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "optim": "adamw_8bit"}
    plain = accelerate_config.parse({"distributed_type": "MULTI_GPU"})
    setup = fit.setup_of("sft", settings, plain, 8)
    assert setup is not None and setup.optim == "adamw_8bit"
    # a DeepSpeed JSON with an optimizer section builds DeepSpeed's own, whatever optim says
    ds = accelerate_config.with_deepspeed_json(
        accelerate_config.parse({"distributed_type": "DEEPSPEED"}),
        {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "ds.json")
    setup = fit.setup_of("sft", settings, ds, 8)
    assert setup is not None and setup.optim == optimizers.DEFAULT_OPTIM


@pytest.mark.unit
def test_orch_plan_takes_the_optim_a_recipe_would_set(plan):
    eight = plan("meta-llama/Llama-3.1-8B-Instruct", "--strategy", "ddp", "--gpus", "8", "--optim", "adamw_8bit")
    assert eight.returncode == 0 and eight.stdout.splitlines()[0].endswith(", optim adamw_8bit"), eight.stdout
    assert "optimizer 15.2," in eight.stdout  # 2 bytes and the absmax, against AdamW's 29.9 GiB
    refused = plan("meta-llama/Llama-3.1-8B-Instruct", "--optim", "adamw")
    assert refused.returncode == 2 and "argument --optim: invalid choice: 'adamw'" in refused.stderr
