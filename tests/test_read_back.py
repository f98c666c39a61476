"""What ran, read back from the processes and said in one line each: the precision (train/precision.py, the compute
dtype a Linear layer returned and the dtypes the innermost optimizer updates; core/precision.py says it), and the
ranks that reported (core/summary.py). The smoke runs read them back from every rank for each strategy
(tests/test_trainers_smoke.py) and the SkyPilot bed from its head node (tests/test_sky_bed.py); these check the parts
on their own."""

import pytest
import torch

from orchestrator.core.precision import line
from orchestrator.train import precision

pytestmark = pytest.mark.unit


def stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None) -> None:
    inputs = torch.ones(2, 4, dtype=next(model.parameters()).dtype)
    with torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False):
        loss = model(inputs).float().sum()
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("loaded, autocast, compute", [
    (torch.float32, None, "float32"), (torch.float32, torch.bfloat16, "bfloat16"),
    (torch.bfloat16, torch.bfloat16, "bfloat16"), (torch.bfloat16, None, "bfloat16")])  # fmt: skip
def test_the_first_forward_and_the_optimizer_say_what_ran(loaded, autocast, compute):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).to(loaded)
    probe = precision.Probe(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepped(model, optimizer, autocast)
    assert probe.facts(optimizer) == {"compute": compute, "updated": [str(loaded)[6:]], "quantized": False}
    assert not model[0]._forward_hooks  # removed once it has seen an output


def test_wrapped_optimizers_are_read_at_the_innermost_and_a_zero3_partition_through_its_state():
    """accelerate's AcceleratedOptimizer and DeepSpeed's ZeRO optimizers keep the optimizer they drive as
    `.optimizer`; ZeRO-3 puts its fp32 partition in the group only for its step, the state stays keyed by it."""
    master = torch.nn.Parameter(torch.zeros(8))
    inner = torch.optim.AdamW([master], lr=1e-3)
    master.grad = torch.ones(8)
    inner.step()
    inner.param_groups[0]["params"] = []  # as DeepSpeed's stage 3 leaves it between steps

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert precision.updated(Wrapper(Wrapper(inner))) == ["float32"]
    assert not precision.Probe(torch.nn.Sequential(torch.nn.Linear(4, 4))).quantized  # no bitsandbytes 4-bit layer


def test_the_line_says_why_weights_are_16_bit_and_what_keeps_them_fp32():
    assert line({"compute": "bfloat16", "updated": ["float32"], "quantized": False}) == (
        "[orch] precision: bf16 compute, fp32 weights updated by the optimizer")
    whole = line({"compute": "bfloat16", "updated": ["bfloat16"], "quantized": False})
    assert whole.startswith("[orch] precision: bf16 compute, bf16 weights updated by the optimizer (no fp32 copy: an "
                            "update under ~1/256 of a weight rounds away; dtype=float32 keeps fp32 weights")
    half = line({"compute": "float16", "updated": ["float16"], "quantized": False})
    assert "fp16 weights updated by the optimizer (no fp32 copy: an update under ~1/2048" in half
    adapter = line({"compute": "bfloat16", "updated": ["bfloat16"], "quantized": True})
    assert adapter.endswith("(the adapter in bf16: TRL casts a 4-bit model's LoRA adapter so, as the QLoRA paper does)")
    assert line(None) is None and line({"compute": None, "updated": ["float32"]}) is None  # no Linear layer ran


def test_the_ranks_that_reported_are_named_in_runs():
    from orchestrator.core.summary import spans

    assert spans([1, 0]) == "0, 1"
    assert spans(list(range(16)) + [17, 18, 19, 24]) == "0-15, 17-19, 24"
    assert spans([3]) == "3" and spans([]) == ""


def test_the_plan_says_ahead_when_the_optimizer_will_update_16_bit_weights_and_what_fp32_would_take():
    import dataclasses

    from orchestrator.core import memory, models
    from orchestrator.core.precision import planned

    setup = memory.Setup(models.KNOWN_ARCHS["qwen/qwen2.5-0.5b-instruct"], strategy="ddp", gpus=4, seq_len=2048)
    fp32 = memory.estimate(dataclasses.replace(setup, weights_dtype="float32"))
    said = planned(setup)
    assert said.startswith("precision: the optimizer will update bf16 weights (DDP over a model loaded in bf16: no "
                           "fp32 copy, an update under ~1/256 of a weight rounds away); dtype=float32 keeps fp32")
    assert said.endswith(f"under bf16 compute at {fp32.describe()}") and fp32.gib > memory.estimate(setup).gib
    for other in ({"strategy": "fsdp"}, {"strategy": "zero2"}, {"method": "lora"}, {"weights_dtype": "float32"}):
        assert planned(dataclasses.replace(setup, **other)) is None, other  # fp32 weights, or an fp32 copy, train
    assert planned(None) is None


def test_a_cluster_runs_summary_leaves_out_ranks_an_earlier_larger_attempt_reported(tmp_path):
    """On a cluster the reports directory is not renewed between attempts (the local backend renews it): a relaunch on
    fewer nodes finds the earlier attempt's reports of ranks its world does not have."""
    import json

    from orchestrator.core.summary import summary

    (tmp_path / "orch").mkdir()
    report = {"rank": 0, "world_size": 1, "distributed_type": "MULTI_GPU", "backend": "nccl", "strategy": {},
              "optimizer_steps_this_run": 4, "optimizer_steps": 8, "total_samples": 64,
              "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "final_model": None}  # fmt: skip
    (tmp_path / "orch" / "rank0.json").write_text(json.dumps(report))
    (tmp_path / "orch" / "rank1.json").write_text(json.dumps({**report, "rank": 1, "world_size": 2}))
    assert summary(tmp_path)[0] == "[orch] ran: MULTI_GPU over nccl, world size 1 (ranks reporting: 0)"


def test_the_head_node_reads_the_ranks_output_dir_from_their_argv_or_else_the_trl_config(tmp_path, capsys):
    """CHECKPOINT_ROOT gives the ranks --output_dir <root>/<run id> (node/script.py); without one they write where the
    TRL config says, which is not in their argv."""
    import json

    from orchestrator.node.exec import summarise

    report = {"rank": 0, "world_size": 1, "distributed_type": "MULTI_GPU", "backend": "nccl", "strategy": {},
              "optimizer_steps_this_run": 0, "optimizer_steps": 8, "total_samples": 0,
              "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "final_model": None}  # fmt: skip
    (tmp_path / "orch").mkdir()
    (tmp_path / "orch" / "rank0.json").write_text(json.dumps(report))
    ran = "[orch] ran: MULTI_GPU over nccl, world size 1 (ranks reporting: 0)"
    summarise(["--module", "orchestrator.train", "sft"], {"output_dir": str(tmp_path)})
    assert ran in capsys.readouterr().out
    summarise(["--output_dir", "elsewhere", "--output_dir", str(tmp_path)], {"output_dir": "outputs/x"})
    assert ran in capsys.readouterr().out
    summarise(["--module", "orchestrator.train", "sft"], {})
    assert capsys.readouterr().out == ""
