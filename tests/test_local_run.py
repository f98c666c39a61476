"""End to end: the local backend runs ONE distributed training over emulated nodes."""

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, orch

pytestmark = pytest.mark.slow


def reports(output_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((output_dir / "orch").glob("rank*.json"))]


def output_dir_of(stdout: str) -> Path:
    match = re.search(r"^\[orch\] output: (\S+)$", stdout, re.M)
    assert match, stdout
    return ROOT / match.group(1)


def test_two_node_smoke_is_one_process_group():
    result = orch("run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # each node printed its own accelerate command, with the TOTAL process count
    for rank in (0, 1):
        line = next(
            line for line in out.splitlines() if line.startswith(f"(node{rank}) [orch] exec: accelerate launch")
        )
        assert "--num_processes 2 --num_machines 2" in line and f"--machine_rank {rank}" in line
        assert "--multi_gpu" in line
    assert "on CPU orch runs DDP over gloo instead" in out
    # from inside the training processes: one group of world size 2, each rank its own
    ranks = reports(output_dir_of(out))
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["distributed_type"] == "MULTI_CPU" and r["backend"] == "gloo"
    head = ranks[0]
    ga = head["gradient_accumulation_steps"]
    assert ga == 8  # smoke global batch 16 = 1 per device x 2 ranks x 8
    assert head["total_samples"] == head["per_device_train_batch_size"] * 2 * ga * head["optimizer_steps_this_run"]
    assert head["local_samples"] + ranks[1]["local_samples"] == head["total_samples"]
    # orch says what ran, and the run left a loss log and a checkpoint
    assert "[orch] ran: MULTI_CPU over gloo, world size 2" in out
    assert re.search(r"\[orch\] step 8/8 loss=\d", out)
    logged = [json.loads(line) for line in (output_dir_of(out) / "orch" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 9))
    assert (output_dir_of(out) / "checkpoint-8" / "orch_complete").is_file()


def test_failing_node_stops_the_gang(tmp_path):
    recipe = tmp_path / "gang.yaml"
    recipe.write_text(
        (ROOT / "recipes" / "phi3_dpo_fsdp.yaml")
        .read_text()
        .replace(
            "run: |\n  orch node",
            'run: |\n  if [ "$SKYPILOT_NODE_RANK" = 1 ]; then echo dying; exit 7; fi\n  sleep 300',
        )
    )
    result = orch("run", str(recipe), "--local", "--nodes", "2", timeout=60)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "(node1) dying" in result.stdout
    assert "[orch] node 1 exited with code 7: stopping the other nodes" in result.stdout
