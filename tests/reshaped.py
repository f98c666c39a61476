"""Resume at another shape (issue 32, item 1): `orch run RECIPE` with other --nodes/--gpus is the same run, resumes
from its checkpoint and trains the losses of the uninterrupted run, said on the node and in the summary.

A recipe's smoke run on 2 x 1 (8 steps, checkpoints at 4 and 8) is the reference; `resumed_at` deletes checkpoint-8
(the attempt lost after step 4) and reruns the same command at another shape: FSDP2 through DCP's resharding load,
DeepSpeed ZeRO-2 and ZeRO-3 through DeepSpeed's universal checkpoint (train/reshape.py). Used where the reference run
is already made for another check: tests/test_scaling.py (FSDP2 2 x 1 -> 1 x 2 and 1 x 1) and
tests/test_trainers_smoke.py (QLoRA, ZeRO-2, ZeRO-3 2 x 1 -> 1 x 1)."""

import shutil
from pathlib import Path

import pytest
from conftest import loss_log, orch


def resumed_at(project: Path, recipe: str, output_dir: Path, expected: dict, *args: str, env=None):
    """Lose checkpoint-8, rerun with `args` (the shape, and the reference's own overrides): the same output directory,
    steps 5-8 as the reference trained them."""
    shutil.rmtree(output_dir / "checkpoint-8")
    rerun = orch("run", recipe, "--local", "--smoke", *args, cwd=project, env=env)
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
