"""A damaged newest checkpoint is skipped, quarantined and training goes on from the previous one, with the losses of
an uninterrupted run (issue 15)."""

import json
import re

import pytest
from conftest import orch
from test_faults import loss_log

COMMAND = ["run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "max_steps=12"]


@pytest.mark.slow
def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(project):
    first = orch(*COMMAND, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", first.stdout, re.M).group(1)
    expected = loss_log(output_dir)
    assert sorted(expected) == list(range(1, 13))
    weights = output_dir / "checkpoint-12" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:  # a save cut short: half the weights file
        fh.truncate(size // 2)

    rerun = orch(*COMMAND, cwd=project)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert (
        f"(node0) [orch] skipping checkpoint-12: model.safetensors has {size // 2} bytes, the manifest says {size}; "
        f"quarantined in {output_dir.relative_to(project) / 'orch_quarantine.jsonl'}, resuming from checkpoint-8\n"
    ) in rerun.stdout, rerun.stdout[-3000:]
    assert re.search(r"resuming from \S+/checkpoint-8$", rerun.stdout, re.M)
    after = loss_log(output_dir)
    assert sorted(after) == [9, 10, 11, 12]
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step
    listed = [json.loads(x) for x in (output_dir / "orch_quarantine.jsonl").read_text().splitlines()]
    assert [x["checkpoint"] for x in listed] == ["checkpoint-12"]
    assert (output_dir / "checkpoint-12" / "model.safetensors").stat().st_size == size  # saved again, whole


def test_fresh_says_what_it_deletes(tmp_path, capsys):
    from types import SimpleNamespace

    from orchestrator.launch.backends.local import forget

    run = tmp_path / "run-1"
    for step in (12, 8):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * 500_000)
    (run / "config.json").write_text("{}")
    forget(SimpleNamespace(envs={"CHECKPOINT_ROOT": str(tmp_path)}, overrides={}), "run-1")
    out = capsys.readouterr().out
    assert re.search(
        r"^\[orch\] --fresh: deleting \S+: checkpoint-8, checkpoint-12 \(1.0 MB\) and the final model$", out, re.M
    )
    assert not run.exists()
