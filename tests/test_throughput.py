"""See the run: tokens/s, ETA, MFU and dollars on every step, checked against a count made without orch's
code: the smoke dataset's tokens, recounted with its tokenizer, over wall time measured outside the training."""

import json
import subprocess
import sys
import time

import pytest

from orchestrator.core.accelerators import peak_tflops
from orchestrator.train.throughput import Meter, tokens_in

pytestmark = pytest.mark.unit


def test_peak_figures_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA L40S") == 362.05 and peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("NVIDIA A10G") is None and peak_tflops("Tesla T4") is None


def test_tokens_exclude_padding_and_say_when_they_cannot():
    import torch

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert tokens_in({"input_ids": torch.ones(2, 4), "attention_mask": mask}) == (5, True)
    grpo = {"prompt_ids": torch.ones(2, 3), "prompt_mask": torch.ones(2, 3), "completion_mask": mask}
    assert tokens_in(grpo) == (11, True)
    assert tokens_in({"input_ids": torch.ones(1, 9), "position_ids": torch.ones(1, 9)}) == (9, True)  # packed
    assert tokens_in({"input_ids": torch.ones(2, 4)}) == (8, False)


def test_time_to_first_step_from_the_submission_on_a_cloud_and_without_a_skewed_clock():
    from orchestrator.core.timeline import time_to_first_step

    # the rehearsal and the download both start when the install ends (scripts/node-setup.sh runs them at once)
    node = {"setup_started": 130.0, "setup_installed": 131.0, "setup_prefetched": 137.0, "setup_rehearsed": 140.0,
            "setup_done": 141.0, "node_started": 142.0, "barrier_passed": 143.0, "model_loaded": 150.0,
            "first_step": 151.0}  # fmt: skip
    line = time_to_first_step({"launched": 100.0, **node})
    assert line.startswith("51.0 s = SkyPilot's provisioning, runtime and job start 30.0 + setup 11.0 (install 1.0, "
                           "rehearsal 9.0 alongside download 6.0) + from setup to orch node 1.0 + ")  # fmt: skip
    # the laptop's clock 5 s ahead of the node's: the figure is left out, the total starts at the setup
    assert time_to_first_step({"launched": 135.0, **node}) == time_to_first_step(node)
    assert time_to_first_step(node).startswith("21.0 s = setup 11.0")
    # a head node whose rehearsal was cached compiles its ranks' imports after it, in the same process (node/warm.py)
    warmed = {**node, "setup_rehearsed": 131.2, "setup_warmed": 140.0}
    assert time_to_first_step(warmed).startswith("21.0 s = setup 11.0 (install 1.0, rehearsal 0.2 then bytecode "
                                                 "warm-up 8.8 alongside download 6.0) + ")  # fmt: skip


def test_figures_and_dollars():
    meter = Meter({"ORCH_PRICE_PER_HOUR": "36"}, started=time.time() - 100)
    meter.flops_per_token, meter.peak = 6e9, 1000.0  # 1B parameters, 1 PFLOPS per device
    meter.train_started = time.time() - 10
    meter.last = (meter.train_started, 0)
    meter.step_times = [1.0, 2.0, 3.0]
    import torch

    figures = meter.sample(torch.tensor([200_000.0]), step=3, max_steps=13, world=4, dist=None)
    assert figures["tokens_per_s"] == pytest.approx(20_000, rel=0.05)
    assert figures["mfu"] == pytest.approx(20_000 * 6e9 / (1000e12 * 4), rel=0.05)
    assert figures["eta_s"] == 10.0 and figures["spent_usd"] == pytest.approx(1.0, rel=0.05)
    assert figures["projected_usd"] == pytest.approx(36 * 110 / 3600, rel=0.05)
    line = meter.describe(figures)
    assert "tok/s" in line and "MFU 3.0%" in line and "ETA 0m10s" in line and "$1.00 spent, $1.10 at the end" in line


@pytest.mark.e2e
def test_throughput_matches_an_independent_count(project):
    """A 2-node SFT smoke run sees every row of the 128-row smoke dataset once (8 steps x 16 samples). Its tokens,
    recounted here with the dataset's own tokenizer and chat template, over the time between the line rank 0 prints
    when training begins and the last step's line (both timestamped here, outside the training), must match
    orch's figure. The same run is asked for a checkpoint mid-run, as SkyPilot's preemption hook asks
    (`orch node --checkpoint-now` writes $ORCH_HOME/checkpoint-request on a node): every rank saves and goes on."""
    import os
    import re
    import tempfile
    from unittest import mock

    from orchestrator.launch.backends.local_nodes import scratch_dir

    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke",
         "--env", "ORCH_SAVE_ON_REQUEST=on"],
        cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen, lines, home = {}, [], None
    for line in proc.stdout:
        lines.append(line)
        if match := re.match(r"^\[orch\] run (\S+):", line):
            run = match.group(1)
        if line.startswith("[orch] output: "):  # node 0's ORCH_HOME, in the run's node directory
            with mock.patch.object(tempfile, "tempdir", os.environ.get("TMPDIR")):  # orch's, not this process's
                home = scratch_dir(run, project / line.split("output: ", 1)[1].strip()) / "node0"
        if "[orch] step 1/8" in line:  # as checkpoint_now does (tested below), without its start-up time
            home.mkdir(parents=True, exist_ok=True)
            (home / "checkpoint-request").write_text("preemption notice\n")
            seen["elastic"] = [p.name[:13] for p in (home / "tmp").glob("torchelastic_*")]  # in the node's TMPDIR
        if "elastic" in seen and "done" not in seen and (home / "checkpoint-done").is_file():  # the node's answer
            if (text := (home / "checkpoint-done").read_text()).endswith("\n"):  # (the home goes with the run)
                seen["done"], seen["asked"] = text.split()[0], (home / "checkpoint-request").exists()
        if "[orch] training: up to step 8" in line:
            seen.setdefault("start", time.monotonic())
        if "[orch] step 8/8" in line:
            seen["end"] = time.monotonic()
    assert proc.wait() == 0, "".join(lines[-30:])
    assert seen["elastic"] == ["torchelastic_"] and not home.parent.exists()  # the run's node directory went with it
    out = "".join(lines)
    assert "tok/s" in out and "ETA" in out and "[orch] time to first step:" in out
    assert "MFU not shown on CPU" in out
    # once the step time is known (step 2): when the smoke schedule's checkpoints come (train/disk.cadence)
    assert re.search(r"\[orch\] checkpoints: the next at step 4 \(~[\d.]+ s at this rate\), then every 4 steps "
                     r"\(~[\d.]+ s\); a failure or a preemption loses the steps since the last one\n", out), out[-3000:]
    # the first save: what a checkpoint takes on the disk, said by node 0 alone (node 1 shares its disk)
    assert re.search(r"^\(node0\) \[orch\] node 0: checkpoint-\d+ takes [\d.]+ MiB on this node's disk \(.+ free\); "
                     r"the \d save\(s\) to come to step 8 fit$", out, re.M), out[-3000:]
    assert "(node1) [orch] node 1: checkpoint-" not in out
    output_dir = project / next(x.split("output: ", 1)[1].strip() for x in lines if x.startswith("[orch] output: "))
    report = json.loads((output_dir / "orch" / "rank0.json").read_text())
    figures = report["throughput"]

    from transformers import AutoTokenizer

    launch = next(x for x in lines if "[orch] launch: " in x).split()
    model = launch[launch.index("--model_name_or_path") + 1]
    smoke = model.rsplit("/", 1)[0]
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(r) for r in open(f"{smoke}/data/train.jsonl")]
    ids = [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"] for r in rows]
    counted = sum(min(64, len(row)) for row in ids)
    assert figures["padding_excluded"] and figures["tokens"] == pytest.approx(counted, rel=0.02), (figures, counted)
    outside = counted / (seen["end"] - seen["start"])
    assert figures["tokens_per_s_run"] == pytest.approx(outside, rel=0.25), (figures, outside)
    assert f"[orch] throughput: {figures['tokens_per_s_run']:,.0f} tok/s over the run" in out
    step = int(re.search(r"checkpoint asked for \(preemption notice\): saving at step (\d+)", out).group(1))
    assert 2 <= step <= 8 and seen["done"] == str(step)
    assert not seen["asked"] and "[orch] step 8/8" in out
    # (checkpoint-<step> itself may have been rotated away by save_total_limit=2 by the end)
    # `orch status` lists it with its last step, loss and rate, read from what the run wrote
    from conftest import orch

    last = [json.loads(x) for x in (output_dir / "orch" / "log.jsonl").read_text().splitlines() if '"loss"' in x][-1]
    listed = orch("status", cwd=project)
    row = next(x for x in listed.stdout.splitlines() if x.startswith(output_dir.name)).split()
    metric = f"mean_token_accuracy={last['mean_token_accuracy']:.4g}"  # SFT's own measure (core/trainers)
    rate = f"{last['tokens_per_s']:,.0f}"
    assert row[row.index("succeeded") + 1 :][:4] == ["8/8", f"{last['loss']:.4g}", metric, rate]


@pytest.mark.e2e
def test_the_cost_cap_stops_after_a_checkpoint_and_says_why(project):
    """$10 per second and a $600 cap: 60 s kept for a save (none timed yet) leaves no room for a second step, so
    the run stops cleanly (exit 0) with a checkpoint after its first step, long before max_steps."""
    import re

    from conftest import orch

    run = orch(
        "run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke", "max_steps=400", "save_steps=1000",
        "--env", "ORCH_PRICE_PER_HOUR=36000", "--max-cost", "600", cwd=project,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    step = int(re.search(r"\[orch\] stopping at step (\d+): cost cap: \$", run.stdout).group(1))
    assert 0 < step < 400
    assert f"[orch] stopped early at step {step}: cost cap:" in run.stdout
    output = next(x.split("output: ", 1)[1].strip() for x in run.stdout.splitlines() if x.startswith("[orch] output:"))
    assert (project / output / f"checkpoint-{step}").is_dir()
    spent = float(re.search(r"\$([\d.]+) spent", run.stdout.split("[orch] stopping at step")[1]).group(1))
    assert spent <= 600 and step == 1  # the room kept for a step and a save: $600
    record = next((project / "sky_jobs").glob("*.yaml")).read_text()
    assert "# state: stopped early (cost cap)" in record and "# stopped: cost cap:" in record


@pytest.mark.e2e
def test_orchs_own_collectives_use_the_groups_device():
    """NCCL (GPU runs) takes only CUDA tensors: orch's all-reduces (tokens, the cost cap, resume step, samples) must
    put theirs on the GPU there; gloo (CPU runs, where every other test runs) takes only CPU ones."""
    from orchestrator.train.collectives import collective_device

    assert collective_device("nccl") == "cuda" and collective_device("cpu:gloo,cuda:nccl") == "cuda"
    assert collective_device("gloo") == "cpu"


def test_the_head_node_takes_the_price_of_where_the_cluster_was_provisioned():
    """SkyPilot sets SKYPILOT_CLUSTER_INFO at each start (failover, a managed job's recovery): the price follows it."""
    from orchestrator.node.price import provisioned

    table = json.dumps({"AWS/us-east-1": 65.5452, "AWS/us-west-2": 70.0})

    def where(region):
        return json.dumps({"cluster_name": "c", "cloud": "AWS", "region": region, "zone": None})

    env = {"ORCH_PRICE_PER_HOUR": "65.5452", "ORCH_PRICES": table}
    assert provisioned({**env, "SKYPILOT_CLUSTER_INFO": where("us-west-2")}) == (
        "70.0000",
        "price: $70.00/h for the cluster as provisioned in AWS/us-west-2 (the plan said $65.55/h)",
    )
    assert provisioned({**env, "SKYPILOT_CLUSTER_INFO": where("us-east-1")}) == (
        "65.5452",
        "price: $65.55/h for the cluster as provisioned in AWS/us-east-1",
    )
    price, said = provisioned({**env, "SKYPILOT_CLUSTER_INFO": where("eu-north-1")})
    assert price == "65.5452" and "AWS/eu-north-1 is not in the launch's price table" in said
    assert provisioned({"ORCH_PRICE_PER_HOUR": "3"}) == ("3", "")  # local runs: the price given
    assert provisioned({}) == ("", "")


def test_checkpoint_now_asks_and_waits(tmp_path, capsys):
    """`orch node --checkpoint-now`: the request file the ranks read, then the wait for the file they write."""
    import threading

    from orchestrator.node.exec import checkpoint_now

    def trainers():
        while not (tmp_path / "checkpoint-request").exists():
            time.sleep(0.05)
        (tmp_path / "checkpoint-done").write_text("7 outputs/run/checkpoint-7\n")

    threading.Thread(target=trainers, daemon=True).start()
    assert checkpoint_now({"ORCH_HOME": str(tmp_path)}, wait=30) == 0
    assert "[orch] checkpoint written at step 7: outputs/run/checkpoint-7" in capsys.readouterr().out
    (tmp_path / "checkpoint-done").unlink()
    assert checkpoint_now({"ORCH_HOME": str(tmp_path)}, wait=0.5) == 1  # nobody training here
    assert "no checkpoint within 0.5 s" in capsys.readouterr().out
