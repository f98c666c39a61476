"""Each TRL trainer smoke-trains through the local backend on 2 emulated nodes (tiny model, synthetic data)."""

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import checkpoint_bytes
import pytest
from conftest import orch
from hub_standin import Hub
from test_faults import processes_with

from orchestrator.core import trainers, trl_schema
from orchestrator.core.final_model import is_final_file
from orchestrator.train.checkpoints import verify

pytestmark = pytest.mark.e2e
SECRET = "hf_SmokeTest_0123456789abcdef"

# One recipe per trainer and per strategy that runs for real on CPU, and between them every model family orch
# ships; what ran is read back from the training processes.
RECIPES = {
    "sft-fsdp2": ("llama3_70b_sft_fsdp", "FSDP2"),  # llama3_sft_fsdp's run, at 70B's settings (same tiny Llama)
    "sft-qlora-fsdp2": ("llama3_70b_qlora_fsdp", "FSDP2"),  # bitsandbytes' 4-bit NF4 on CPU, for real
    "grpo": ("qwen25_grpo_vllm_server", "MULTI_CPU"),
    "kto": ("qwen25_kto_ddp", "MULTI_CPU"),
    "reward": ("qwen25_reward_ddp", "MULTI_CPU"),
    "sft-qwen3-alst": ("qwen3_sft_alst", "DeepSpeed ZeRO-3 + Ulysses SP2"),
    "dpo-zero2": ("qwen25_dpo_zero2", "DeepSpeed ZeRO-2"),
    "sft-zero3": ("llama3_sft_zero3", "DeepSpeed ZeRO-3"),  # offload too runs on CPU: +1.5 min of CPU Adam build
}


def check_adapter(result, project, lora: bool, qlora: bool = False) -> Path:
    """PEFT really trained an adapter (4-bit base layers for QLoRA), read back from the training process."""
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)
    adapter = json.loads((output_dir / "orch" / "rank0.json").read_text())["adapter"]
    if not lora:
        assert adapter is None
        return output_dir
    assert 0 < adapter["trainable_params"] < adapter["params"] / 2, adapter  # a tiny model: r16 is a big share
    assert (adapter["linear4bit"] > 0) == qlora, adapter
    if qlora:  # every linear layer of the tiny Llama is bitsandbytes' 4-bit one, counted once (not PEFT's wrapper)
        launch = next(x for x in result.stdout.splitlines() if "[orch] launch: " in x).split()
        model = Path(launch[launch.index("--model_name_or_path") + 1])
        assert adapter["linear4bit"] == 7 * json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert "Hugging Face format: PEFT's from_pretrained loads it on its base model" in result.stdout
    assert (output_dir / "adapter_model.safetensors").is_file() and (output_dir / "adapter_config.json").is_file()
    # every trained tensor is in the file, under the names PEFT loads (an FSDP2 run with activation checkpointing
    # wrote an adapter with no tensors: PEFT's selection missed the checkpoint wrapper's module names), and LoRA's
    # B matrices, zero at the start, have trained
    from safetensors import safe_open

    with safe_open(str(output_dir / "adapter_model.safetensors"), "pt") as fh:
        names = list(fh.keys())
        assert len(names) == 2 * len([n for n in names if ".lora_A." in n]) > 0, names
        assert all("_checkpoint_wrapped_module" not in n and ".default." not in n for n in names), names
        assert any(fh.get_tensor(n).abs().sum() > 0 for n in names if ".lora_B." in n)
    assert "[orch] trained: a LoRA adapter" in result.stdout
    strategy = json.loads((output_dir / "orch" / "rank0.json").read_text())["strategy"]
    if "[orch] ran: MULTI_CPU" in result.stdout:  # the LoRA DDP recipes: no search for unused parameters at every
        # step (transformers' default for a PeftModel), read from DDP itself
        assert strategy == {"ddp_find_unused_parameters": False}, strategy
    return output_dir


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
    # the trainer's own measures (a reward, an accuracy) under TRL's names: each step line and the summary show them;
    # a TRL that renames one fails here
    spec = trainers.spec(trainer)
    shown = spec.headline([r for r in losses if "loss" in r][-1])
    for pattern in spec.metrics:
        assert any(fnmatch.fnmatchcase(key, pattern) for key, _ in shown), (pattern, sorted(losses[-1]))
    step_line = next(x for x in out.splitlines() if "[orch] step 8/8 loss=" in x)
    for key, value in shown:
        assert f" {key}={value:.4g}" in step_line, (key, step_line)
        assert re.search(rf"^\[orch\] {re.escape(key)}: step 1 -?[\d.]+ -> step 8 {value:.4f}$", out, re.M), key


# What the first step computed in and what its optimizer updated, read from every rank (train/precision.py). Smoke
# runs train in fp32; two cases keep their recipe's bf16, which the CPU runs: FSDP2's mixed-precision policy over the
# fp32 weights accelerate upcasts, and DDP's autocast over the bf16 weights the model loaded in (no fp32 copy).
RECIPE_PRECISION = {"sft-fsdp2": ("bfloat16", ["float32"]), "kto": ("bfloat16", ["bfloat16"])}
SMOKE_PRECISION = {"sft-qlora-fsdp2": ("float32", ["bfloat16"])}  # TRL casts a 4-bit model's adapter to bf16

# The same run resumed on 1 x 1 from checkpoint-4 (issue 32, tests/reshaped.py): what the resume says it resharded.
# DeepSpeed refuses another world size ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world
# size is not currently supported"); orch converts with DeepSpeed's own ds_to_universal into node-local scratch, loads
# that, and deletes it; ZeRO-3's losses also need train/reshape.untie_steps (DeepSpeed's universal load shares one
# `step` tensor between the optimizer's groups). FSDP2 checkpoints of a PEFT adapter held none of it
# (train/fsdp_adapter.py): the resume trained the adapter again from its initialisation (step 5: 5.786 against 5.471)
# and said nothing; a checkpoint written the old way is refused before step 1 (tests/test_adapter_checkpoints.py).
RESHAPED = {
    "sft-qlora-fsdp2": "torch.distributed.checkpoint on load",
    "dpo-zero2": "DeepSpeed's universal checkpoint, 2 -> 1 ZeRO partitions",
    "sft-zero3": "DeepSpeed's universal checkpoint, 2 -> 1 ZeRO partitions",
}


@pytest.mark.parametrize("label", list(RECIPES))
def test_trainer_smoke_trains_on_two_nodes(project, tmp_path, label):
    recipe, ran = RECIPES[label]
    evaluated = label == "dpo-zero2"  # an eval_strategy too: evaluation on the smoke data's one split, every 4 steps
    # and a metric_for_best_model, which transformers looks up in each evaluation's metrics (a KeyError when absent)
    extra = ["eval_strategy=steps", "eval_steps=4", "metric_for_best_model=rewards/accuracies"] if evaluated else []
    streamed = label == "sft-fsdp2"  # the big-SFT case streams its dataset (TRL's dataset_streaming, as its scripts do)
    extra += ["dataset_streaming=true"] if streamed else []
    extra += ["bf16=true", "dtype=bfloat16"] if label in RECIPE_PRECISION else []
    result = orch("run", recipe, "--local", "--nodes", "2", "--smoke", *extra, cwd=project)
    check_one_group(result, project, label.split("-")[0], ran)
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)
    # its checkpoint and final model, as big as the launch side's disk estimate (core/disk_need.py) for the settings
    # it ran with: every strategy's bytes a parameter, copies and dtype, measured
    checkpoint_bytes.check(result.stdout, project, output_dir)
    precision = {json.dumps(json.loads(p.read_text())["precision"]) for p in (output_dir / "orch").glob("rank*.json")}
    compute, updated = RECIPE_PRECISION.get(label, SMOKE_PRECISION.get(label, ("float32", ["float32"])))
    facts = {"compute": compute, "updated": updated, "quantized": "qlora" in label}
    assert precision == {json.dumps(facts)}, precision  # every rank's first step
    short = {"bfloat16": "bf16", "float32": "fp32"}
    said = f"[orch] precision: {short[compute]} compute, {short[updated[0]]} weights updated by the optimizer"
    assert result.stdout.count(said) == 2, result.stdout[-3000:]  # at the first step (node 0) and in the summary
    if label == "kto":
        assert f"{said} (no fp32 copy: an update under ~1/256 of a weight rounds away; dtype=float32" in result.stdout
    if "qlora" in label:
        assert f"{said} (the adapter in bf16: TRL casts a 4-bit model's LoRA adapter so" in result.stdout
    # the recipe's activation checkpointing, as it ran (smoke runs keep it): FSDP's wrappers or transformers' flags
    launch = next(x for x in result.stdout.splitlines() if "[orch] launch: " in x).split()
    layers = json.loads((Path(launch[launch.index("--model_name_or_path") + 1]) / "config.json").read_text())[
        "num_hidden_layers"]  # fmt: skip
    by = {"fsdp": layers if ran == "FSDP2" else 0, "transformers": 0 if ran == "FSDP2" else layers}
    assert json.loads((output_dir / "orch" / "rank0.json").read_text())["recompute"] == {"layers": layers, **by}
    assert f"[orch] recomputed in the backward: {layers} decoder layer(s), {layers} by" in result.stdout
    datasets = {json.loads(p.read_text())["train_dataset"] for p in (output_dir / "orch").glob("rank*.json")}
    assert datasets == {"IterableDataset" if streamed else "Dataset"}, datasets  # as each rank's trainer holds it
    if evaluated:  # each evaluation's line, with the trainer's own measures eval_-named, and the summary's
        for step in (4, 8):
            assert re.search(rf"^\(node0\) \[orch\] eval at step {step}/8: eval_loss=[\d.]+ "
                             r"eval_rewards/accuracies=[\d.]+ eval_rewards/margins=-?[\d.]+$", result.stdout, re.M)
        assert re.search(r"^\[orch\] eval_loss: step 4 [\d.]+ -> step 8 [\d.]+ \(2 evaluation\(s\)\)$", result.stdout,
                         re.M), result.stdout[-3000:]  # fmt: skip
        # what the evaluations reported, every name of it in the snapshot metric_for_best_model is checked against
        records = [json.loads(line) for line in (output_dir / "orch" / "log.jsonl").read_text().splitlines()]
        reported = {k.removeprefix("eval_") for r in records if "eval_loss" in r for k in r if k.startswith("eval_")}
        table = trl_schema._schema()["eval_metrics"]
        assert "rewards/accuracies" in reported and reported <= {*table["every"], *table["dpo"]}, reported
        state = json.loads((output_dir / "checkpoint-8" / "trainer_state.json").read_text())
        assert state["best_metric"] is not None and state["best_model_checkpoint"], state  # the lookup ran
    output_dir = check_adapter(result, project, lora="lora" in label, qlora="qlora" in label)
    if "qlora" in label:  # `orch pull` of a local run: the final model's files from its output dir, no more
        run = re.search(r"^\[orch\] run (\S+):", result.stdout, re.M).group(1)
        pulled = orch("pull", run, "pulled", cwd=project)
        assert pulled.returncode == 0, pulled.stderr
        assert f"final model from outputs/{output_dir.name} -> pulled (" in pulled.stdout
        pulled_files = sorted(p.name for p in (project / "pulled").iterdir())
        assert pulled_files == sorted(p.name for p in output_dir.iterdir() if p.is_file() and is_final_file(p.name))
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(pulled_files)
    if ran.startswith("DeepSpeed"):
        output_dir = project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)
        assert len(list((output_dir / "checkpoint-8").glob("global_step8/*optim_states.pt"))) == 2
        assert "DeepSpeed: 2 per-rank optimizer state file(s)" in result.stdout
        # read from the live comm backend of every rank: DeepSpeed's shared-memory op was neither built nor used
        for report in (output_dir / "orch").glob("rank*.json"):
            assert json.loads(report.read_text())["strategy"]["shm_comm"] is False
        assert "deepspeed_shm_comm" not in result.stdout
    if label in RESHAPED:  # the same run, resumed on 1 x 1 from checkpoint-4 at the uninterrupted losses
        from conftest import loss_log
        from reshaped import resumed_at, said

        scratch = tmp_path / "scratch"
        rerun = resumed_at(project, recipe, output_dir, loss_log(output_dir), "--nodes", "1", *extra,
                           env={"ORCH_SCRATCH_DIR": str(scratch)})  # fmt: skip
        said(rerun, f"[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 1 (resharded: "
                    f"{RESHAPED[label]})")  # fmt: skip
        assert f"[orch] ran: {ran} over gloo, world size 1 (ranks reporting: 0)\n" in rerun.stdout, rerun.stdout[-2000:]
        if ran.startswith("DeepSpeed"):
            assert list(scratch.iterdir()) == [scratch / "orch-universal"]
            assert list((scratch / "orch-universal").iterdir()) == []  # the conversion is gone once every rank loaded
            assert not [p for p in (output_dir / "checkpoint-4").iterdir() if "universal" in p.name]
        if "qlora" in label:
            assert "base in 4-bit: 14 Linear4bit layers (QLoRA)" in rerun.stdout


def test_copied_template_runs_on_the_users_own_file(project):
    """A copied template, trained on 2 nodes on a preference file of the user's: a sample of its rows. The
    template is the LoRA DPO recipe, so this is also its smoke run (a copy is the recipe, file for file)."""
    copied = orch("cp", "llama3_dpo_lora_ddp", "my_dpo", cwd=project)
    assert copied.returncode == 0, copied.stderr
    assert (project / "recipes" / "my_dpo.yaml").is_file() and (project / "recipes" / "trl" / "my_dpo.yaml").is_file()
    rows = [{"prompt": [{"role": "user", "content": f"Double {i}?"}],
             "chosen": [{"role": "assistant", "content": f"{2 * i}"}],
             "rejected": [{"role": "assistant", "content": f"{2 * i + 1}"}]} for i in range(300)]  # fmt: skip
    mine = project / "prefs.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = orch("run", "my_dpo", "--local", "--nodes", "2", "--smoke", "--data", "prefs.jsonl", cwd=project)
    check_one_group(result, project, "dpo", "MULTI_CPU")
    check_adapter(result, project, lora=True)
    assert "recipe my_dpo (dpo)" in result.stdout
    assert "[orch] data: prefs.jsonl (300 rows) has the columns TRL's dpo trainer reads; the smoke run trains on its " \
        "first 128" in result.stdout  # fmt: skip
    launch = next(x for x in result.stdout.splitlines() if "[orch] launch: " in x).split()
    dataset = Path(launch[launch.index("--dataset_name") + 1])
    assert dataset.parent == Path(os.environ["ORCH_CACHE_DIR"]) / "data"  # orch's cache (the session's, in tests)
    assert (dataset / "train.jsonl").read_text().splitlines() == mine.read_text().splitlines()[:128]


def test_the_rows_trl_leaves_out_are_counted_and_an_empty_split_is_refused(project):
    """TRL's DPO trainer drops a row whose prompt alone fills max_length, without a word: the run says how many rows
    it trained on (rank 0's line, the summary, the rank report), and a split left empty is one line naming the
    setting, where torch said `num_samples should be a positive integer value, but got num_samples=0`."""
    long = "Think about this long question on arithmetic and numbers first. " * 6

    def rows(prompts):
        pair = {"chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}
        return "".join(json.dumps({"prompt": [{"role": "user", "content": q}], **pair}) + "\n" for q in prompts)

    (project / "some.jsonl").write_text(rows([f"{long}{i}+2?" if i % 3 == 0 else f"{i}+2?" for i in range(24)]))
    (project / "all.jsonl").write_text(rows([f"{long}{i}+2?" for i in range(8)]))
    why = "each row whose prompt alone fills max_length=64 (truncation_mode=keep_start; keep_end keeps them)"
    some = orch("run", "phi3_dpo_fsdp", "--local", "--smoke", "--data", "some.jsonl", cwd=project)
    assert some.returncode == 0, some.stdout[-3000:]
    assert f"(node0) [orch] data: TRL's dpo trainer kept 16 of 24 training rows (8 left out, 33%): it drops {why}\n" \
        in some.stdout  # fmt: skip
    assert f"\n[orch] data: trained on 16 of the split's 24 rows; TRL's dpo trainer left out 8: {why}\n" in some.stdout
    (report,) = (project / "outputs").glob("*/orch/rank0.json")
    assert json.loads(report.read_text())["rows"] == {"given": 24, "kept": 16, "why": why}
    empty = orch("run", "phi3_dpo_fsdp", "--local", "--smoke", "--data", "all.jsonl", cwd=project)
    assert empty.returncode == 1
    assert empty.stdout.strip().splitlines()[-1].endswith(
        f"exited with code 1: ValueError: TRL's dpo trainer kept none of the 8 training rows: it drops {why}; raise "
        "max_length, or give shorter rows"
    ), empty.stdout[-2000:]


def run_watching_a_secret(project: Path, env: dict, secret: str, *args: str):
    """`orch *args`; once its training processes are up, every process of the run and every command line on the
    machine is read: (the run's result, whether the secret reached the nodes' environment, command lines seen)."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=project, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    run, in_env, cmdlines, launchers, lines = None, False, [], [], []
    for line in proc.stdout:
        lines.append(line)
        match = re.match(r"^\[orch\] run (\S+):", line)
        run = run or (match.group(1) if match else None)
        if run and "[orch] rank " in line:
            ours = set(processes_with(f"SKYPILOT_TASK_ID={run}"))
            in_env = in_env or bool(ours & set(processes_with(f"HF_TOKEN={secret}")))
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    cmdlines.append(path.read_bytes())
                except OSError:
                    continue
                if int(path.parent.name) in ours and b"\0accelerate.commands.launch\0" in cmdlines[-1]:
                    launchers.append(cmdlines[-1].decode().split("\0")[:-1])
    result = subprocess.CompletedProcess(proc.args, proc.wait(), "".join(lines), "")
    return result, in_env, cmdlines, launchers


def test_lora_sft_pushes_its_adapter_to_the_hub_and_pull_brings_it_back(project, tmp_path):
    """LoRA SFT of the 8B recipe (tiny Llama) on 2 nodes, --push-to-hub to a stand-in Hub (huggingface_hub's own
    client over HTTP): only the final model's files are uploaded; `orch pull` downloads them and PEFT loads them.
    The token, a `--secret`, reaches the nodes' environment and never a file, a log line or a command line."""
    with Hub(tmp_path / "hub", token=SECRET) as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}
        result, in_env, cmdlines, launchers = run_watching_a_secret(
            project, env, SECRET, "run", "llama3_sft_lora_ddp", "--local", "--nodes", "2", "--smoke",
            "--push-to-hub", "me/tiny-lora", "--secret", "HF_TOKEN",
        )  # fmt: skip
        check_one_group(result, project, "sft", "MULTI_CPU")
        # each node ran the accelerate launch it printed, as `python -m accelerate.commands.launch` (node/exec.py)
        printed = sorted(x.split(" accelerate launch ", 1)[1] for x in result.stdout.splitlines() if "launch: " in x)
        assert len(printed) == 2 and sorted(shlex.join(argv[3:]) for argv in launchers[:2]) == printed, launchers
        assert all(argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"] for argv in launchers)
        assert in_env, "the nodes never received the secret (the test would prove nothing)"
        assert cmdlines and not any(SECRET.encode() in c for c in cmdlines if b"pytest" not in c)
        for path in project.rglob("*"):
            if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".log", ".md", ".txt", ""):
                assert SECRET not in path.read_text(errors="replace"), path
        record = next((project / "sky_jobs").glob("*.yaml")).read_text()
        assert "HF_TOKEN: null" in record and "--secret HF_TOKEN" in record
        check_adapter(result, project, lora=True)
        on_hub = sorted(p.name for p in (tmp_path / "hub" / "models" / "me" / "tiny-lora").iterdir())
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(on_hub), on_hub
        assert not [n for n in on_hub if n.startswith(("checkpoint", "orch", "trackio", "log"))], on_hub
        assert f"[orch] final model on the Hub: {hub.endpoint}/me/tiny-lora ({', '.join(on_hub)})" in result.stdout
        assert hub.token not in result.stdout + result.stderr
        posts = [r for r in hub.requests if r.startswith("POST")]
        assert posts[0] == "POST /api/repos/create" and posts[-1] == "POST /api/models/me/tiny-lora/commit/main"
        run = re.search(r"^\[orch\] run (\S+):", result.stdout, re.M).group(1)
        cache = {"HF_HOME": str(tmp_path / "hf")}  # where the pull's download is cached: not this machine's ~/.cache
        pulled = orch("pull", run, str(tmp_path / "mine"), cwd=project, env={**env, **cache})
    assert pulled.returncode == 0, pulled.stderr
    assert f"final model from the Hub (me/tiny-lora) -> {tmp_path / 'mine'} ({len(on_hub)} files" in pulled.stdout
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "mine"))
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == json.loads(
        next((project / "outputs").rglob("rank0.json")).read_text())["adapter"]["trainable_params"]  # fmt: skip


def test_rloo_trains_with_its_rewards_and_reference_model(project):
    """RLOO (TRL's RLOOTrainer), added as a registry entry and a recipe: 2 emulated nodes, one world, the smoke
    reward scoring its completions and a KL term against the reference model TRL keeps at its default beta 0.05."""
    result = orch("run", "qwen25_rloo_ddp", "--local", "--nodes", "2", "--smoke", cwd=project)
    check_one_group(result, project, "rloo", "MULTI_CPU")
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)
    logged = [json.loads(x) for x in (output_dir / "orch" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert all("rewards/digit_reward/mean" in r and r["completions/mean_length"] > 0 for r in steps), steps[0]
    # the recipe's own reward (TRL's accuracy_reward, math_verify) scored every completion beside the smoke reward
    assert all("rewards/accuracy_reward/mean" in r for r in steps), steps[0]
    assert steps[0]["kl"] == 0 and max(r["kl"] for r in steps) > 0  # the policy moves away from a real reference
