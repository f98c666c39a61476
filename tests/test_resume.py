"""A damaged newest checkpoint is skipped, quarantined and training goes on from the previous one, with the losses of
an uninterrupted run; its Trackio curves (--track) continue from that checkpoint."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import loss_log, orch

pytestmark = pytest.mark.e2e

COMMAND = ["run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "max_steps=8", "--track"]

READ_BACK = """
import json, sys
from trackio.api import Api
from trackio.sqlite_storage import SQLiteStorage
runs = list(Api().runs(sys.argv[1]))
print(json.dumps({r.name: SQLiteStorage.get_logs(sys.argv[1], r.name) for r in runs}))
"""


def trackio_runs(trackio_dir, project: str) -> dict:
    """{run: [rows]} through Trackio's own API (its TRACKIO_DIR is read at import: a process of its own)."""
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir)}
    done = subprocess.run([sys.executable, "-c", READ_BACK, project], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.e2e
def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(project):
    first = orch(*COMMAND, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", first.stdout, re.M).group(1)
    expected = loss_log(output_dir)
    assert sorted(expected) == list(range(1, 9))
    weights = output_dir / "checkpoint-8" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:  # a save cut short: half the weights file
        fh.truncate(size // 2)

    rerun = orch(*COMMAND, cwd=project)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert (
        f"(node0) [orch] skipping checkpoint-8: model.safetensors has {size // 2} bytes, the manifest says {size}; "
        f"quarantined in {output_dir.relative_to(project) / 'orch_quarantine.jsonl'}, resuming from checkpoint-4\n"
    ) in rerun.stdout, rerun.stdout[-3000:]
    assert re.search(r"resuming from \S+/checkpoint-4$", rerun.stdout, re.M)
    after = loss_log(output_dir)
    assert sorted(after) == [5, 6, 7, 8]
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step
    listed = [json.loads(x) for x in (output_dir / "orch_quarantine.jsonl").read_text().splitlines()]
    assert [x["checkpoint"] for x in listed] == ["checkpoint-8"]
    assert (output_dir / "checkpoint-8" / "model.safetensors").stat().st_size == size  # saved again, whole

    # Trackio: one run, every node's rows, and the loss curve of the uninterrupted run (steps 5-8 of the first
    # attempt were not in checkpoint-4's copy, so none is there twice)
    run = output_dir.name
    shown = orch("dashboard", run, "--no-open", cwd=project, env={"ORCH_CACHE_DIR": str(project / "cache")})
    assert shown.returncode == 0, shown.stderr
    assert f"[orch] merged 2 node(s) of project 'qwen25_sft_ddp' into {project / 'cache'}" in shown.stdout
    runs = trackio_runs(project / "cache" / "dashboards" / run / "trackio", "qwen25_sft_ddp")
    assert list(runs) == [run]
    rows = runs[run]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == list(range(1, 9)) and len([r for r in rows if "loss" in r]) == 8
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step
    for node in (0, 1):
        steps = sorted(r["step"] for r in rows if f"node{node}/tokens" in r)
        assert steps == list(range(1, 9)), (node, steps)
    last = {k: v for r in rows if r["step"] == 8 for k, v in r.items()}
    assert last["node0/tokens"] + last["node1/tokens"] == last["tokens"]  # the nodes' shares add up
    assert last["node1/tokens_per_s"] > 0
    assert "(node1) [orch] tracking node 1 in Trackio project 'qwen25_sft_ddp'" in rerun.stdout
    assert "(continuing from step 4)" in rerun.stdout

    # TRL's resume_from_checkpoint: another output_dir trains on from the checkpoint given, at the same losses
    elsewhere = project / "elsewhere"
    given = orch(*COMMAND, f"output_dir={elsewhere}", f"resume_from_checkpoint={output_dir / 'checkpoint-4'}",
                 cwd=project)  # fmt: skip
    assert given.returncode == 0, given.stdout[-3000:]
    said = f"(node0) [orch] rank 0/2: distributed_type=MULTI_CPU device=cpu:0 backend=gloo resuming from {output_dir}/"
    assert f"{said}checkpoint-4\n" in given.stdout, given.stdout[-3000:]
    resumed = loss_log(elsewhere)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step

    # the TRL config edited between runs: resuming checkpoint-8 is refused on the node, naming the change, until
    # ORCH_RESUME_CHANGED=on (which keeps the run: the same output dir) resumes it and says so (issue 30, item 7)
    assert json.loads((output_dir / "checkpoint-8" / "orch_config.json").read_text())["shape"] == {
        "nodes": 2, "per_node": 1, "world": 2}  # fmt: skip
    config = project / "recipes" / "trl" / "qwen25_sft.yaml"
    config.write_text(config.read_text() + "max_grad_norm: 0.5\n")  # smoke pins the schedule, not this
    changed = orch(*COMMAND, cwd=project)
    assert changed.returncode != 0
    said = "checkpoint-8 was trained with other settings: max_grad_norm 1.0 -> 0.5; to resume anyway set ORCH_RESUME_"
    assert said in changed.stdout, changed.stdout[-3000:]
    anyway = orch(*COMMAND, "--env", "ORCH_RESUME_CHANGED=on", cwd=project)
    assert anyway.returncode == 0, anyway.stdout[-3000:]
    assert f"[orch] output: {output_dir.relative_to(project)}" in anyway.stdout
    said = "[orch] resuming checkpoint-8 with changed settings (ORCH_RESUME_CHANGED=on): max_grad_norm 1.0 -> 0.5"
    assert said in anyway.stdout


@pytest.mark.parametrize("recipe,steps", [("qwen25_sft_ddp", "4"), ("qwen25_grpo_ddp", "8")])
def test_a_rerun_of_a_finished_run_trains_no_step_past_max_steps(project, recipe, steps):
    # transformers' loop checks max_steps only after a step: with an epoch longer than max_steps (SFT's smoke epoch is 8
    # steps; GRPO's generation batches make its epoch longer than 8) the rerun, resumed from checkpoint-<max_steps>,
    # trained one more step and saved checkpoint-<max_steps + 1>, then wrote that model as the final one
    command = ["run", recipe, "--local", "--nodes", "2", "--smoke", f"max_steps={steps}"]
    first = orch(*command, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", first.stdout, re.M).group(1)
    final = (output_dir / "model.safetensors").read_bytes()
    again = orch(*command, cwd=project)
    out = again.stdout
    assert again.returncode == 0, out[-3000:]
    assert f"[orch] resumed at step {steps}, max_steps {steps}: nothing left to train" in out, out[-3000:]
    assert not re.search(rf"\[orch\] step {int(steps) + 1}/{steps} ", out), out[-3000:]
    assert "already the last step: nothing left to train" in out
    assert sorted(p.name for p in output_dir.glob("checkpoint-*"))[-1] == f"checkpoint-{steps}"
    assert (output_dir / "model.safetensors").read_bytes() == final  # written again from checkpoint-<max_steps>
