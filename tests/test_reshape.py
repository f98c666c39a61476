"""Resume at another shape (issue 32, item 1): `orch run RECIPE` with other --nodes/--gpus is the same run, resumes
from its checkpoint and trains the losses of the uninterrupted run, said on the node and in the summary.

Each test trains the recipe's smoke run on 2 x 1 (the reference, 8 steps, checkpoints at 4 and 8), deletes checkpoint-8
(the attempt lost after step 4) and reruns the same command at another shape: FSDP2 through DCP's resharding load,
DeepSpeed ZeRO-2 and ZeRO-3 through DeepSpeed's universal checkpoint (train/reshape.py)."""

import json
import re
import shutil

import pytest
from conftest import orch
from test_faults import loss_log

pytestmark = pytest.mark.e2e


def reference(project, recipe: str):
    first = orch("run", recipe, "--local", "--nodes", "2", "--smoke", cwd=project)
    assert first.returncode == 0, first.stdout[-3000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", first.stdout, re.M).group(1)
    expected = loss_log(output_dir)
    assert sorted(expected) == list(range(1, 9))
    return output_dir, expected


def resumed_at(project, recipe: str, output_dir, expected, *shape: str, env=None):
    """Lose checkpoint-8, rerun at `shape`: the same output directory, steps 5-8 as the reference trained them."""
    shutil.rmtree(output_dir / "checkpoint-8")
    rerun = orch("run", recipe, "--local", "--smoke", *shape, cwd=project, env=env)
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    assert f"[orch] output: {output_dir.relative_to(project)}\n" in rerun.stdout  # the same run
    after = loss_log(output_dir)
    assert sorted(after) == [5, 6, 7, 8], rerun.stdout[-3000:]
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), (step, rerun.stdout[-3000:])
    return rerun


def said(rerun, line: str) -> None:
    """On the node (rank 0) and in the summary, from rank 0's report."""
    assert f"(node0) {line}" in rerun.stdout, rerun.stdout[-3000:]
    assert f"\n{line}\n" in rerun.stdout


def test_fsdp2_resumes_on_one_node_of_two_processes_and_on_one_process(project):
    output_dir, expected = reference(project, "llama3_sft_fsdp")
    rerun = resumed_at(project, "llama3_sft_fsdp", output_dir, expected, "--nodes", "1", "--gpus", "CPU:2")
    said(rerun, "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 2 (world size 2 -> 2: the same "
                "partitions)")  # fmt: skip
    rerun = resumed_at(project, "llama3_sft_fsdp", output_dir, expected, "--nodes", "1")
    said(rerun, "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 1 (resharded: "
                "torch.distributed.checkpoint on load)")  # fmt: skip
    report = json.loads((output_dir / "orch" / "rank0.json").read_text())
    assert report["world_size"] == 1 and report["resumed_from"].endswith("checkpoint-4")


@pytest.mark.parametrize("recipe, stage", [("qwen25_dpo_zero2", "ZeRO-2"), ("llama3_sft_zero3", "ZeRO-3")])
def test_deepspeed_resumes_on_one_node_through_its_universal_checkpoint(project, tmp_path, recipe, stage):
    """DeepSpeed refuses another world size ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
    world size is not currently supported"); orch converts with DeepSpeed's own ds_to_universal into node-local
    scratch, loads that, and deletes it. ZeRO-3's losses also need train/reshape.untie_steps (DeepSpeed's universal
    load shares one `step` tensor between the optimizer's groups)."""
    output_dir, expected = reference(project, recipe)
    scratch = tmp_path / "scratch"
    rerun = resumed_at(project, recipe, output_dir, expected, "--nodes", "1", env={"ORCH_SCRATCH_DIR": str(scratch)})
    assert f"ran: DeepSpeed {stage} over gloo, world size 1" in rerun.stdout
    said(rerun, "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 1 (resharded: DeepSpeed's "
                "universal checkpoint, 2 -> 1 ZeRO partitions)")  # fmt: skip
    assert list(scratch.iterdir()) == [scratch / "orch-universal"]
    assert list((scratch / "orch-universal").iterdir()) == []  # the conversion is gone once every rank loaded it
    assert sorted(p.name for p in (output_dir / "checkpoint-4").iterdir() if "universal" in p.name) == []


def test_a_qlora_adapter_resumes_on_one_node_at_the_uninterrupted_losses(project):
    """FSDP2 checkpoints of a PEFT adapter held none of it (train/fsdp_adapter.py): the resume trained the adapter
    again from its initialisation (step 5: 5.786 against 5.471) and said nothing. Now its losses are the
    uninterrupted run's, at another shape too. A checkpoint written the old way is refused before step 1:
    tests/test_adapter_checkpoints.py."""
    output_dir, expected = reference(project, "llama3_70b_qlora_fsdp")
    rerun = resumed_at(project, "llama3_70b_qlora_fsdp", output_dir, expected, "--nodes", "1")
    said(rerun, "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 1 (resharded: "
                "torch.distributed.checkpoint on load)")  # fmt: skip
    assert "base in 4-bit: 14 Linear4bit layers (QLoRA)" in rerun.stdout
