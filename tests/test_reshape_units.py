"""train/reshape.py on its own: which resumes need resharding and how, what DeepSpeed's files say, the scratch keyed
per node, the step tensors ZeRO-3's universal load shares. The runs themselves: tests/reshaped.py."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.train import reshape

pytestmark = pytest.mark.unit


def accelerator(kind: str, processes: int, sp: int = 1):
    parallelism = SimpleNamespace(sp_size=sp, cp_size=1) if sp > 1 else None
    return SimpleNamespace(distributed_type=SimpleNamespace(value=kind), num_processes=processes,
                           parallelism_config=parallelism)  # fmt: skip


def deepspeed_checkpoint(path: Path, ranks: int, prefix: str = "") -> Path:
    (path / "global_step4").mkdir(parents=True)
    (path / "latest").write_text("global_step4\n")
    for rank in range(ranks):
        (path / "global_step4" / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (path / "global_step4" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"x")
    return path


def test_deepspeeds_own_files_say_the_saved_partitions(tmp_path):
    assert reshape.deepspeed_saved_world(deepspeed_checkpoint(tmp_path / "z2", 2)) == 2
    assert reshape.deepspeed_saved_world(deepspeed_checkpoint(tmp_path / "bf16", 4, prefix="bf16_")) == 4
    assert reshape.deepspeed_saved_world(tmp_path) is None  # no `latest`: not DeepSpeed's


def test_how_each_strategy_gets_to_another_shape(tmp_path):
    ckpt = deepspeed_checkpoint(tmp_path / "checkpoint-4", 2)
    assert reshape.method(accelerator("DEEPSPEED", 2), ckpt, 2) == ""
    assert reshape.method(accelerator("DEEPSPEED", 1), ckpt, 2) == (
        "resharded: DeepSpeed's universal checkpoint, 2 -> 1 ZeRO partitions")
    # Ulysses sequence parallelism: 4 processes in groups of 2 are 2 data-parallel ranks, as saved
    assert reshape.method(accelerator("DEEPSPEED", 4, sp=2), ckpt, 4) == ""
    assert reshape.method(accelerator("FSDP", 1), tmp_path, 2) == "resharded: torch.distributed.checkpoint on load"
    assert reshape.method(accelerator("FSDP", 2), tmp_path, 2) == ""
    assert reshape.method(accelerator("MULTI_CPU", 4), tmp_path, 2) == (
        "replicated weights and optimizer: nothing to reshard")


def test_scratch_is_per_node_and_named_safely(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_SCRATCH_DIR", str(tmp_path))
    first = reshape.scratch_for(Path("/ckpt/checkpoint-4"), "run/../x", 0)
    assert first.parent == tmp_path / "orch-universal" / "run-..-x" / "node0"
    assert re.fullmatch(r"checkpoint-4-[0-9a-f]{8}", first.name)
    assert reshape.scratch_for(Path("/ckpt/checkpoint-4"), "run/../x", 0) == first
    assert reshape.scratch_for(Path("/ckpt/checkpoint-4"), "run/../x", 1) != first
    # the same run id from another checkout (its own outputs) converts elsewhere
    assert reshape.scratch_for(Path("/other/ckpt/checkpoint-4"), "run/../x", 0) != first


def test_one_shared_step_tensor_becomes_one_per_group():
    """What DeepSpeed's ZeRO-3 universal load leaves (one `step` for every group): torch's Adam then counts each step
    once per group; after untie_steps each group counts its own."""
    import torch

    weights, norms = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [weights]}, {"params": [norms], "weight_decay": 0.0}])
    for p in (weights, norms):
        p.grad = torch.ones_like(p)
    optimizer.step()
    shared = torch.tensor(4.0)
    for p in (weights, norms):
        optimizer.state[p]["step"] = shared
    assert reshape.untie_steps(SimpleNamespace(optimizer=optimizer)) == 1
    optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in (weights, norms)] == [5.0, 5.0]
    assert reshape.untie_steps(optimizer) == 0


def test_a_checkpoint_of_another_strategy_is_named_before_anything_loads(tmp_path):
    """DeepSpeed, FSDP and DDP each load only their own checkpoints: on CPU the ALST recipe (ZeRO-3 + Ulysses sp 2)
    runs as one process on 1 x 1 (measured: its resume was refused for `use_cpu False -> True, ddp_backend ...`,
    settings that follow from the strategy), and a changed accelerate config does the same on GPUs."""
    saved, now = {"nodes": 2, "per_node": 1, "world": 2}, {"nodes": 1, "per_node": 1, "world": 1}
    ds = deepspeed_checkpoint(tmp_path / "ds" / "checkpoint-4", 2)
    fsdp = tmp_path / "fsdp" / "checkpoint-4"
    (fsdp / "pytorch_model_fsdp_0").mkdir(parents=True)
    plain = tmp_path / "ddp" / "checkpoint-4"
    plain.mkdir(parents=True)
    (plain / "model.safetensors").write_bytes(b"x")
    assert [reshape.saved_by(c) for c in (ds, fsdp, plain)] == ["DeepSpeed", "FSDP", "DDP or a single process"]
    assert reshape.other_format(accelerator("NO", 1), ds, saved, now) == (
        "checkpoint-4 was saved by DeepSpeed on 2 x 1, and this run is DDP or a single process (1 x 1), which cannot "
        "load it: resume it with DeepSpeed (the shape it was saved on runs it), or start a new run in another "
        f"output_dir, or empty this one ({ds.parent}: `orch run --fresh` deletes it when orch made it for this same "
        "run, rm -r otherwise)")
    assert reshape.other_format(accelerator("DEEPSPEED", 1), fsdp, {}, now).startswith(
        "checkpoint-4 was saved by FSDP, and this run is DeepSpeed (1 x 1)")
    assert reshape.other_format(accelerator("FSDP", 1), tmp_path / "absent", saved, now) == ""  # not a traceback
    for kind, ckpt in (("DEEPSPEED", ds), ("FSDP", fsdp), ("MULTI_CPU", plain), ("NO", plain), ("MULTI_GPU", plain)):
        assert reshape.other_format(accelerator(kind, 1), ckpt, saved, now) == ""
