"""End to end: the local backend runs ONE distributed training over emulated nodes."""

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, orch

from orchestrator.train.checkpoints import verify

pytestmark = pytest.mark.e2e
SECRET = "tok_0123456789abcdef"


def reports(output_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((output_dir / "orch").glob("rank*.json"))]


def output_dir_of(stdout: str, project: Path) -> Path:
    match = re.search(r"^\[orch\] output: (\S+)$", stdout, re.M)
    assert match, stdout
    return project / match.group(1)


def check_demo_run(result, project: Path) -> None:
    """`orch run phi3_dpo_fsdp --local --nodes 2 --smoke` (the demo) is ONE process group over both nodes. Called by
    test_scaling.py on its "fsdp2 2x1" run: the same command, run once for both."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # each node printed its own accelerate command, with the TOTAL process count
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"(node{rank}) [orch] launch: accelerate launch"))
        assert "--num_processes 2 --num_machines 2" in line and f"--machine_rank {rank}" in line
        assert "--config_file recipes/accelerate/fsdp2_phi3.yaml --mixed_precision no" in line
        assert line.endswith("--use_cpu true") and "--multi_gpu" not in line
    assert "(node1) [orch] node 1/2: 1 process(es) here, 2 in all, head 127.0.0.1, running FSDP2 over gloo" in out
    assert "instead" not in out  # no fallback note: the recipe's strategy ran
    # no third-party notice nobody can act on (DeepSpeed's "Setting accelerator to CPU" is printed by every CPU
    # run); each node says how many lines it hid
    from orchestrator.node.output import notice

    assert not [x for x in out.splitlines() if notice(x.partition(") ")[2], cpu=True)], out[-3000:]
    assert re.search(r"^\(node0\) \[orch\] node 0: hid \d+ line\(s\) of third-party notices", out, re.M), out[-3000:]
    # from inside the training processes: one group of world size 2, each rank its own
    output_dir = output_dir_of(out, project)
    ranks = reports(output_dir)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["distributed_type"] == "FSDP" and r["backend"] == "gloo"
        facts = r["strategy"]  # read from the trained model in each process: DTensor parameters, policy and ref
        assert facts["fsdp_version"] == 2 and facts["state_dict_type"] == "SHARDED_STATE_DICT"
        assert facts["sharded_params"] == facts["params"] > 0 and facts["ref_sharded_params"] == facts["ref_params"]
    head = ranks[0]
    ga = head["gradient_accumulation_steps"]
    assert ga == 8  # smoke global batch 16 = 1 per device x 2 ranks x 8
    assert head["total_samples"] == head["per_device_train_batch_size"] * 2 * ga * head["optimizer_steps_this_run"]
    assert head["local_samples"] + ranks[1]["local_samples"] == head["total_samples"]
    # orch says what ran, and the run left a loss log and a checkpoint
    assert "[orch] ran: FSDP2 over gloo, world size 2" in out
    assert re.search(r"^\[orch\] sharded: (\d+)/\1 parameters on every rank \(DTensor\), reference model", out, re.M)
    assert re.search(r"\[orch\] step 8/8 loss=\d", out)
    logged = [json.loads(x) for x in (output_dir / "orch" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 9))
    # it trains: the smoke pairs (an answer over a refusal) are learnt in 8 steps, so a pipeline whose optimizer,
    # gradients or reference model did not work would show here (DPO's loss stays at log 2 = 0.6931 then)
    losses = [r for r in logged if "loss" in r]
    first, last = losses[0], losses[-1]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3) and last["loss"] < 0.4, (first, last)
    assert last["rewards/accuracies"] >= 0.9 and last["rewards/margins"] > 0.5, last
    assert not verify(output_dir / "checkpoint-8", node=0) and not verify(output_dir / "checkpoint-8", node=1)
    shards = sorted(p.name for p in (output_dir / "checkpoint-8" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank: a sharded checkpoint
    assert "checkpoint-8 (sharded: 2 distcp shard file(s) in pytorch_model_fsdp_0/)" in out
    # the final model: reported by the training process, loadable by transformers itself
    assert head["final_model"]["loadable"] and head["final_model"]["path"] == str(output_dir.relative_to(project))
    assert re.search(rf"^\[orch\] final model: {re.escape(head['final_model']['path'])} \(model.safetensors", out, re.M)
    # the time to the first step, recorded by the node and the training process, adds up
    line = re.search(r"^\[orch\] time to first step: ([\d.]+) s = (.*) \(seconds\)$", out, re.M)
    assert line, out[-3000:]
    parts = dict(re.fullmatch(r"(.*) ([\d.]+)", p).groups() for p in line.group(2).split(" + "))
    assert list(parts) == ["starting the node", "waiting for the other nodes", "launch and model load", "first step"]
    assert sum(map(float, parts.values())) == pytest.approx(float(line.group(1)), abs=0.25)
    assert head["timeline"]["first_step"] > head["timeline"]["model_loaded"] > head["timeline"]["barrier_passed"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert model.config.model_type == "phi3" and model.num_parameters() > 0
    # the run is recorded as a SkyPilot task, and `orch logs` replays its output
    record = project / "sky_jobs" / f"{output_dir.name}.yaml"
    assert "# state: succeeded" in record.read_text() and "# backend: local (2 emulated node(s)" in record.read_text()
    import sky
    assert sky.Task.from_yaml(str(record)).num_nodes == 2
    logs = orch("logs", record.stem, cwd=project)
    assert logs.returncode == 0 and "(node1) [orch] launch: accelerate launch" in logs.stdout


def _recipe_with_run(project: Path, run: str) -> Path:
    recipe = project / "recipes" / "custom.yaml"
    text = (ROOT / "recipes" / "phi3_dpo_fsdp.yaml").read_text()
    head, _, _ = text.partition("\nrun: |\n")
    recipe.write_text(head + "\nrun: |\n" + "".join(f"  {x}\n" for x in run.splitlines()))
    return recipe


def test_failing_node_stops_the_gang(project):
    _recipe_with_run(project, 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then echo dying; exit 7; fi\nsleep 300')
    result = orch("run", "custom", "--local", "--nodes", "2", cwd=project, timeout=60)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "(node1) dying" in result.stdout
    assert "[orch] node 1 exited with code 7: stopping the other nodes" in result.stdout
    (record,) = (project / "sky_jobs").glob("*.yaml")
    assert "# state: failed (exit 7)" in record.read_text()


def test_secret_reaches_nodes_only_through_their_environment(project):
    _recipe_with_run(project, 'echo "node $SKYPILOT_NODE_RANK sees a ${#MY_TOKEN}-character token"')
    result = orch(
        "run",
        "custom",
        "--local",
        "--nodes",
        "2",
        "--secret",
        "MY_TOKEN",
        cwd=project,
        env={"MY_TOKEN": SECRET},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"(node1) node 1 sees a {len(SECRET)}-character token" in result.stdout
    written = [p.read_text() for p in project.rglob("*") if p.is_file() and "recipes" not in p.parts]
    assert written and not any(SECRET in text for text in written)
    assert SECRET not in result.stdout + result.stderr
    assert "MY_TOKEN: null" in next((project / "sky_jobs").glob("*.yaml")).read_text()


def test_trls_fsdp2_profile_with_full_state_dict_checkpoints_writes_its_final_model(project):
    """TRL's own fsdp2 profile (ACCELERATE_CONFIG: fsdp2) keeps FULL_STATE_DICT checkpoints, which transformers saves
    through save_pretrained, and that sets config.dtype to a string: the final save then failed on rank 0 with
    `Invalid device string: 'float32'` after every step had trained (train/checkpoints.load_dtype)."""
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--env", "ACCELERATE_CONFIG=fsdp2",
                  cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[orch] ran: FSDP2 over gloo, world size 2" in result.stdout
    output_dir = output_dir_of(result.stdout, project)
    assert (output_dir / "checkpoint-4" / "pytorch_model_fsdp.bin").is_file()  # a full state dict checkpoint
    assert re.search(r"^\[orch\] final model: \S+ \(model\.safetensors, F32, [\d.]+ kB\)", result.stdout, re.M)


def test_a_logging_interval_beyond_the_last_step_is_said(project):
    """logging_steps past max_steps logs no step: no loss line, and orch's non-finite check and straggler naming, which
    judge at logging steps, never run; rank 0 says so as training begins."""
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "logging_steps=20", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:]
    assert ("(node0) [orch] warning: logging_steps=20 is beyond max_steps=8: no step will be logged (no loss, and the "
            "non-finite check and the straggler naming judge at logging steps)\n") in result.stdout  # fmt: skip
    assert "[orch] step " not in result.stdout


def test_evaluations_that_would_take_much_of_the_run_are_said_at_the_first(project):
    """Timed at the first evaluation after two timed steps (rank 0: from the last step's end to on_evaluate) against
    each step's own time: evaluating every step, one row at a time, over the smoke data's split, where a step trains
    one row (GLOBAL_BATCH_SIZE=1), takes most of this run (~96-97% measured). Three steps: each evaluation reads the
    whole split, which made the smoke run's 8 take a minute of the suite under its load."""
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "--env", "GLOBAL_BATCH_SIZE=1",
                  "eval_strategy=steps", "eval_steps=1", "per_device_eval_batch_size=1", "max_steps=3",
                  cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    said = re.findall(r"^\(node0\) \[orch\] warning: the evaluation at step (\d) took [\d.]+ s and a step takes [\d.]+ "
                      r"s: the run's 3 evaluations would take ~(\d+)% of it \(.*\); eval_steps=(\d+) keeps them near a "
                      r"tenth, or evaluate on fewer rows$", result.stdout, re.M)  # fmt: skip
    assert len(said) == 1 and int(said[0][1]) >= 50 and int(said[0][2]) > 1, said or result.stdout[-3000:]
