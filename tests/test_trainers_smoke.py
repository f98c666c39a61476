"""Each TRL trainer smoke-trains through the local backend on 2 emulated nodes (tiny model, synthetic data)."""

import json
import re
from pathlib import Path

import pytest
from conftest import orch

from orchestrator.train.checkpoints import verify

pytestmark = pytest.mark.slow

# One recipe per trainer and per strategy that runs for real on CPU, and between them every model family orch
# ships; what ran is read back from the training processes.
RECIPES = {
    "sft-fsdp2": ("llama3_sft_fsdp", "FSDP2"),
    "grpo": ("qwen25_grpo_vllm_server", "MULTI_CPU"),
    "kto": ("qwen25_kto_ddp", "MULTI_CPU"),
    "reward": ("qwen25_reward_ddp", "MULTI_CPU"),
    "sft-qwen3-alst": ("qwen3_sft_alst", "DeepSpeed ZeRO-3 + Ulysses SP2"),
    "dpo-zero2": ("qwen25_dpo_zero2", "DeepSpeed ZeRO-2"),
    "sft-zero3": ("llama3_sft_zero3", "DeepSpeed ZeRO-3"),  # offload too runs on CPU: +1.5 min of CPU Adam build
}


def check_one_group(result, project, trainer: str, ran: str = "FSDP2"):
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    out = result.stdout
    assert f"[orch] ran: {ran} over gloo, world size 2" in out, out[-2000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", out, re.M).group(1)
    ranks = [json.loads(p.read_text()) for p in sorted((output_dir / "orch").glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    head = ranks[0]
    assert head["optimizer_steps"] == 8
    assert head["total_samples"] == 16 * 8, head  # smoke global batch 16 x 8 steps
    assert not verify(output_dir / "checkpoint-8", node=0) and not verify(output_dir / "checkpoint-8", node=1)
    losses = [json.loads(x) for x in (output_dir / "orch" / "log.jsonl").read_text().splitlines()]
    assert len([r for r in losses if "loss" in r]) == 8


@pytest.mark.parametrize("label", list(RECIPES))
def test_trainer_smoke_trains_on_two_nodes(project, label):
    recipe, ran = RECIPES[label]
    result = orch("run", recipe, "--local", "--nodes", "2", "--smoke", cwd=project)
    check_one_group(result, project, label.split("-")[0], ran)
    if ran.startswith("DeepSpeed"):
        output_dir = project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)
        assert len(list((output_dir / "checkpoint-8").glob("global_step8/*optim_states.pt"))) == 2
        assert "DeepSpeed: 2 per-rank optimizer state file(s)" in result.stdout


def test_copied_template_runs_on_the_users_own_file(project):
    """A copied template, trained on 2 nodes on a preference file of the user's (issue 19): a sample of its rows."""
    copied = orch("cp", "phi3_dpo_fsdp", "my_dpo", cwd=project)
    assert copied.returncode == 0, copied.stderr
    assert (project / "recipes" / "my_dpo.yaml").is_file() and (project / "recipes" / "trl" / "my_dpo.yaml").is_file()
    rows = [{"prompt": [{"role": "user", "content": f"Double {i}?"}],
             "chosen": [{"role": "assistant", "content": f"{2 * i}"}],
             "rejected": [{"role": "assistant", "content": f"{2 * i + 1}"}]} for i in range(300)]  # fmt: skip
    mine = project / "prefs.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = orch("run", "my_dpo", "--local", "--nodes", "2", "--smoke", "--data", "prefs.jsonl", cwd=project,
                  env={"ORCH_CACHE_DIR": str(project / "cache")})  # fmt: skip
    check_one_group(result, project, "dpo")
    assert "recipe my_dpo (dpo)" in result.stdout
    assert "[orch] data: prefs.jsonl (300 rows) has the columns TRL's dpo trainer reads; the smoke run trains on its " \
        "first 128" in result.stdout  # fmt: skip
    launch = next(x for x in result.stdout.splitlines() if "[orch] launch: " in x).split()
    dataset = Path(launch[launch.index("--dataset_name") + 1])
    assert dataset.parent == project / "cache" / "data"
    assert (dataset / "train.jsonl").read_text().splitlines() == mine.read_text().splitlines()[:128]
