"""The SkyPilot side, with no network: SkyPilot's own parser, a fake SDK, the real optimizer in-process."""

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import sky
import yaml
from conftest import ROOT
from fake_sky import FakeSky

from orchestrator import cli

pytestmark = pytest.mark.cli

SECRET = "hf_s3cr3t_VALUE_never_written"


@pytest.fixture
def in_project(project, monkeypatch):
    """The scratch project as the current directory: in-process CLI calls write sky_jobs/ there."""
    monkeypatch.chdir(project)
    return project


@pytest.fixture
def fake(monkeypatch):
    fake = FakeSky(sky)
    monkeypatch.setitem(sys.modules, "sky", fake)
    return fake


def run_files(project: Path) -> list[Path]:
    return sorted((project / "sky_jobs").glob("*.yaml"))


def test_cluster_launch_sends_secrets_as_secrets(in_project, fake, capsys):
    code = cli.main(
        [
            "run",
            "phi3_dpo_fsdp",
            "--gpus",
            "A100:8",
            "--nodes",
            "2",
            "--secret",
            f"HF_TOKEN={SECRET}",
            "--idle-minutes",
            "30",
            "--down",
            "-y",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert fake.names() == ["launch", "tail_logs"]
    _, task, kw = fake.calls[0]
    (record,) = run_files(in_project)
    assert kw["cluster_name"] == record.stem and kw["idle_minutes_to_autostop"] == 30 and kw["down"] is True
    assert task.num_nodes == 2
    assert {str(k): v for k, v in list(task.resources)[0].accelerators.items()} == {"A100": 8}
    assert "HF_TOKEN" in task.secrets and "HF_TOKEN" not in task.envs
    assert task.secrets["HF_TOKEN"].get_secret_value() == SECRET
    assert fake.calls[1][2] == {"cluster_name": record.stem, "job_id": 7, "follow": True}
    # the record: a valid SkyPilot task with the secret's name and never its value
    text = record.read_text()
    assert SECRET not in text and SECRET not in out.out + out.err
    assert "HF_TOKEN: null" in text and "# backend: sky-cluster" in text and "# job_id: 7" in text
    assert "--secret HF_TOKEN" in text  # the header's relaunch command and the recorded orch command
    relaunched = sky.Task.from_yaml(str(record))
    assert relaunched.num_nodes == 2 and relaunched.envs["GLOBAL_BATCH_SIZE"] == "64"


def test_managed_job_and_its_commands(in_project, fake, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    code = cli.main(
        [
            "run",
            "phi3_dpo_fsdp",
            "--managed",
            "--spot",
            "--secret",
            "HF_TOKEN",
            "--detach",
            "--num-nodes",
            "2",
            "learning_rate=1e-6",
            "--yes",
        ]
    )
    assert code == 0
    assert fake.names() == ["jobs.launch"]
    _, task, kw = fake.calls[0]
    (record,) = run_files(in_project)
    assert kw == {"name": record.stem}
    assert list(task.resources)[0].use_spot
    assert task.envs["TRL_OVERRIDES"] == "learning_rate=1e-6"
    assert "ORCH_LAUNCHED_AT" not in task.envs  # the controller would send the first submission's time at each recovery
    assert "# job_id: 42" in record.read_text() and "# backend: sky-managed" in record.read_text()
    # recovery on orch's retryable exit (a hang, a lost node, NCCL), and a checkpoint on the preemption notice
    (resources,) = list(task.resources)
    assert {k: v for k, v in resources.job_recovery.items() if v is not None} == {
        "max_restarts_on_errors": 3, "recover_on_exit_codes": [75]}  # as SkyPilot parsed it
    saved = yaml.safe_load(record.read_text())
    assert saved["config"]["hooks"] == [{"run": '"${ORCH_VENV:-${ORCH_HOME:-$HOME/.orch}/venv}/bin/orch" node --checkpoint-now '
                                         "--wait 150", "events": ["preemption"], "timeout": 180}]  # fmt: skip
    assert task.envs["ORCH_SAVE_ON_REQUEST"] == "on"

    run = record.stem
    assert cli.main(["status"]) == 0
    assert "RECOVERING, 1 recovery" in capsys.readouterr().out
    assert cli.main(["logs", run, "--follow"]) == 0
    assert cli.main(["cancel", run]) == 0
    assert fake.names()[-3:] == ["jobs.queue", "jobs.tail_logs", "jobs.cancel"]
    assert fake.calls[-1][2] == {"job_ids": [42]}
    assert "# state: cancelled" in record.read_text()
    assert SECRET not in capsys.readouterr().out + record.read_text()


def test_cluster_commands_map_to_cluster_calls(in_project, fake, capsys):
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "my-dpo", "--detach", "-y"]) == 0
    (record,) = run_files(in_project)
    assert cli.main(["status"]) == 0
    assert "cluster UP" in capsys.readouterr().out
    assert cli.main(["logs", record.stem[:12]]) == 0  # reading: a unique prefix is enough
    for verb in ("cancel", "down"):  # stopping: the full name
        assert cli.main([verb, record.stem]) == 0
    assert fake.names() == ["launch", "status", "queue", "tail_logs", "cancel", "down"]
    assert fake.calls[-2][2] == {"cluster_name": "my-dpo", "job_ids": [7]}
    assert fake.calls[-1][2] == {"cluster_name": "my-dpo"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "Z999:8"], "unknown accelerator 'Z999'"),
        (["--gpus", "H1000:8"], "did you mean H100?"),
        (["--gpus", "A100:0"], "must be a positive integer"),
        (["--gpus", "A100:x"], "is not a whole number"),
        (["--nodes", "0"], "at least 1 node"),
        (["--gpus", "A100:8", "--fresh"], "--fresh and --netns are for runs on this machine"),
        (["--gpus", "A100:8", "--netns"], "--fresh and --netns are for runs on this machine"),
        (["--cluster", "bad name!"], "--cluster 'bad name!'"),
        (["--nodes", "3"], "GLOBAL_BATCH_SIZE=64 is not a multiple"),
    ],
)
def test_bad_launch_input_sends_nothing_and_writes_nothing(in_project, fake, capsys, argv, message):
    assert cli.main(["run", "phi3_dpo_fsdp", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert fake.calls == [] and run_files(in_project) == []


def test_a_step_over_the_gpus_memory_sends_nothing_and_auto_fit_launches_the_batch_the_refusal_names(in_project,
                                                                                                       fake, capsys):
    """qwen25_dpo_zero2 at max_length=16384 on A100-40GBs: ~44.9 GiB a GPU at 4 sequences a device, refused before
    anything is sent, naming the smaller per-device batch that fits with the same global batch; --auto-fit launches
    that batch, said in one line, and the task SkyPilot gets carries it."""
    argv = ["run", "qwen25_dpo_zero2", "max_length=16384", "--gpus", "A100:8", "--detach", "-y"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "; set per_device_train_batch_size=2 (~28.8 GiB; GLOBAL_BATCH_SIZE=64 kept: 4 accumulation steps)" in err
    assert fake.calls == [] and run_files(in_project) == []
    assert cli.main([*argv, "--auto-fit"]) == 0
    out = capsys.readouterr().out
    assert ("[orch] --auto-fit: the step needs ~44.9 GiB of one A100's 40 at per_device_train_batch_size=4; "
            "per_device_train_batch_size=2 (~28.8 GiB; GLOBAL_BATCH_SIZE=64 kept: 4 accumulation steps)\n") in out
    _, task, _ = fake.calls[0]
    assert task.envs["TRL_OVERRIDES"] == "max_length=16384 per_device_train_batch_size=2"
    assert len(run_files(in_project)) == 1
    # with --data, whose dataset words the first attempt added to its overrides: the second starts from the user's
    pairs = in_project / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "hi", "chosen": "hello", "rejected": "go away"}) + "\n")
    assert cli.main([*argv, "--auto-fit", "--data", str(pairs)]) == 0, capsys.readouterr().err
    _, task, _ = fake.calls[-1]
    assert task.envs["TRL_OVERRIDES"] == ("max_length=16384 per_device_train_batch_size=2 dataset_name=/orch-data "
                                          "dataset_train_split=train")  # fmt: skip


@pytest.mark.parametrize("argv, said, trl", [
    # the evaluation's batch: transformers' 8 sequences of 32k tokens do not fit beside the states
    (["qwen3_sft_fsdp_cp", "eval_strategy=steps"],
     [r"evaluation needs ~53\.\d GiB of one A100's 40 at per_device_eval_batch_size=8; per_device_eval_batch_size=(\d) "
      r"\(~\d+\.\d GiB\)"], "packing=false eval_strategy=steps per_device_eval_batch_size={0}"),
    # GRPO without vLLM: the step's batch, then (the step fitting) fewer completions generated at once
    (["qwen25_grpo_ddp", "use_vllm=false", "max_completion_length=30000"],
     [r"the step needs ~88\.7 GiB of one A100's 40 at per_device_train_batch_size=8; per_device_train_batch_size=2 "
      r"\(~36\.1 GiB; GLOBAL_BATCH_SIZE=256 kept: 16 accumulation steps\)",
      r"generating needs ~49\.0 GiB of one A100's 40; steps_per_generation=8 \(~31\.3 GiB: 16 completions at a time, "
      r"2 generations an optimizer step\)"],
     "use_vllm=false max_completion_length=30000 per_device_train_batch_size=2 steps_per_generation=8"),
])  # fmt: skip
def test_auto_fit_applies_each_memory_refusals_fix_in_turn(in_project, fake, capsys, argv, said, trl):
    """The memory check runs the step first, then the evaluation and the generation where the step fits: --auto-fit
    applies each refusal's fix (a DoesNotFit) in turn, one line each, and launches what fits; without it the first
    refusal sends nothing."""
    command = ["run", *argv, "--gpus", "A100:8", "--detach", "-y"]
    assert cli.main(command) == 2
    assert fake.calls == [] and run_files(in_project) == []
    capsys.readouterr()
    assert cli.main([*command, "--auto-fit"]) == 0, capsys.readouterr().err
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[orch] --auto-fit: ")]
    assert len(lines) == len(said), lines
    found = [re.fullmatch(r"\[orch\] --auto-fit: " + pattern, line) for pattern, line in zip(said, lines, strict=True)]
    assert all(found), lines
    _, task, _ = fake.calls[0]
    assert task.envs["TRL_OVERRIDES"] == trl.format(*found[0].groups())


def test_dry_run_prints_every_rank_and_sends_nothing(in_project, fake, capsys):
    assert cli.main(["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run", "--skip-optimizer"]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"rank {rank}: accelerate launch"))
        assert "--num_processes 16" in line and f"--machine_rank {rank}" in line
    assert "batch: GLOBAL_BATCH_SIZE 64 = 4 per device x 16 data-parallel ranks x 1 accumulation steps" in out
    assert "not computed: --skip-optimizer" in out
    assert fake.calls == [] and run_files(in_project) == []


# Public on-demand list prices (USD/h, us-east-1) of the instances in this small catalog; a made-up dearer
# us-west-2 row for failover.
VMS_CSV = """\
InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch
p4d.24xlarge,A100,8.0,96.0,1152.0,"{'Gpus': [{'Name': 'A100', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 40960}}], 'TotalGpuMemoryInMiB': 327680}",32.7726,9.8318,us-east-1,us-east-1a,x86_64
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{'Gpus': [{'Name': 'A100-80GB', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 655360}",40.9657,12.2897,us-east-1,us-east-1a,x86_64
p4d.24xlarge,A100,8.0,96.0,1152.0,"{'Gpus': [{'Name': 'A100', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 40960}}], 'TotalGpuMemoryInMiB': 327680}",35.0,10.5,us-west-2,us-west-2a,x86_64
g5.48xlarge,A10G,8.0,192.0,768.0,"{'Gpus': [{'Name': 'A10G', 'Manufacturer': 'NVIDIA', 'Count': 8, 'MemoryInfo': {'SizeInMiB': 24576}}], 'TotalGpuMemoryInMiB': 196608}",16.288,4.8864,us-east-1,us-east-1a,x86_64
m6i.2xlarge,,,8.0,32.0,,0.384,0.1152,us-east-1,us-east-1a,x86_64
"""
ACCELERATORS_CSV = 'AcceleratorName,Clouds\nA100,"AWS, GCP, Azure"\nA100-80GB,"AWS, GCP, Azure"\nA10G,AWS\n'
METADATA_CSV = "GPU,MemoryGB,Manufacturer\nA100,40,NVIDIA\nA100-80GB,80,NVIDIA\nA10G,24,NVIDIA\n"

DRY_RUN = """
import sys
import sky.check, sky.clouds
sky.check.get_cached_enabled_clouds_or_refresh = lambda *a, **k: [sky.clouds.AWS()]
from orchestrator.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_dry_run_runs_skypilots_optimizer_on_a_local_catalog(tmp_path):
    env = seeded_catalog(tmp_path)
    argv = ["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run"]
    result = subprocess.run(
        [sys.executable, "-c", DRY_RUN, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "AWS us-east-1 p4d.24xlarge x 2 node(s), on-demand: $32.77/h per node, $65.55/h in all" in out
    assert "estimated cost: EXPECTED_GPU_HOURS 40 / 16 GPUs = 2.50 h (ideal scaling) x $65.55/h = $163.86" in out
    assert "sky-payload" not in out
    spot = subprocess.run(
        [sys.executable, "-c", DRY_RUN, *argv, "--spot"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert "p4d.24xlarge x 2 node(s), spot: $9.83/h per node" in spot.stdout, spot.stderr
    capped = subprocess.run(
        [sys.executable, "-c", DRY_RUN, *argv, "--max-cost", "150"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert capped.returncode == 2
    assert capped.stderr.strip().splitlines()[-1] == (
        "orch: error: the estimated cost $163.86 exceeds --max-cost $150.00: raise the cap, use fewer or cheaper GPUs "
        "(--gpus, --spot), or lower max_steps / num_train_epochs"
    )


@pytest.mark.e2e
def test_host_memory_at_load_is_checked_against_the_planned_instance(tmp_path, project):
    """The 70B full-SFT recipe's load (rank 0 reads the checkpoint and upcasts it: ~394 GiB) against the memory of the
    instance SkyPilot's optimizer picks, from SkyPilot's catalog: p4de.24xlarge's 1152 GiB hold it; the same row
    with a made-up 256 GiB is refused before anything is launched, naming the resources line that fixes it, by the
    dry run and by a launch with -y (no question asked, the same checks)."""
    argv = ["run", "llama3_70b_sft_fsdp", "--gpus", "A100-80GB:8", "--nodes", "4", "--secret", "HF_TOKEN", "--dry-run"]

    def dry_run(env):
        return subprocess.run([sys.executable, "-c", DRY_RUN, *argv], cwd=ROOT, env={**env, "HF_TOKEN": "x"},
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    fits = dry_run(seeded_catalog(tmp_path / "big"))
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert ("host memory at load: ~394.2 GiB on the busiest node, fits 1152 GiB (p4de.24xlarge in SkyPilot's "
            "catalog)") in fits.stdout  # fmt: skip

    env = seeded_catalog(tmp_path / "small")
    vms = Path(env["SKY_RUNTIME_DIR"]) / ".sky" / "catalogs" / "v8" / "aws" / "vms.csv"
    vms.write_text(vms.read_text().replace("p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,", "p4de.24xlarge,A100-80GB,8.0,96.0,256.0,"))
    refused = dry_run(env)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("orch: error: loading needs ~394.2 GiB of host memory on the busiest node (FSDP2, ")
    assert last.endswith("more than 90% of the 256 GiB of p4de.24xlarge in SkyPilot's catalog; set `memory: 439+` "
                         "under resources in the recipe (SkyPilot then plans a node with at least that much)")  # fmt: skip

    launch = [sys.executable, "-c", CONFIRM.format(tests=str(Path(__file__).parent)), *argv[:-1], "-y"]
    refused = subprocess.run(launch, cwd=project, env={**env, "HF_TOKEN": "x", "ORCH_REHEARSAL": "off"},
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1] == last
    assert "CALLS []" in refused.stdout and not (project / "sky_jobs").exists()  # nothing sent, nothing written


@pytest.mark.e2e
def test_zero3_offloads_host_memory_while_training_is_checked_against_the_planned_instance(tmp_path):
    """ZeRO-3 with CPU offload keeps the node's share of the bf16 weights, fp32 master weights and Adam's moments in
    host memory for the whole run (~105 GiB for the 8B recipe on one node), more than its load needs: g5.48xlarge's
    768 GiB hold it; the same row with a made-up 100 GiB is refused, naming the memory line and more nodes."""
    argv = ["run", "llama3_sft_zero3_offload", "--gpus", "A10G:8", "--secret", "HF_TOKEN", "--dry-run"]

    def dry_run(env):
        return subprocess.run([sys.executable, "-c", DRY_RUN, *argv], cwd=ROOT, env={**env, "HF_TOKEN": "x"},
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    fits = dry_run(seeded_catalog(tmp_path / "big"))
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert re.search(r"^host memory at load: ~\d+\.\d GiB on the busiest node; ~10\d\.\d GiB per node while training "
                     r"\(CPU offload\), fits 768 GiB \(g5\.48xlarge in SkyPilot's catalog\)$", fits.stdout,
                     re.M), fits.stdout[-3000:]  # fmt: skip
    env = seeded_catalog(tmp_path / "small")
    vms = Path(env["SKY_RUNTIME_DIR"]) / ".sky" / "catalogs" / "v8" / "aws" / "vms.csv"
    vms.write_text(vms.read_text().replace("g5.48xlarge,A10G,8.0,192.0,768.0,", "g5.48xlarge,A10G,8.0,192.0,100.0,"))
    refused = dry_run(env)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert re.fullmatch(r"orch: error: CPU offload needs ~10\d\.\d GiB of host memory per node while training "
                        r"\(.*\), more than 90% of the 100 GiB of g5\.48xlarge in SkyPilot's catalog; set `memory: 11\d\+` "
                        r"under resources in the recipe \(.*\), or more nodes \(--nodes: each holds a smaller share\)",
                        refused.stderr.strip().splitlines()[-1]), refused.stderr[-2000:]  # fmt: skip


@pytest.mark.e2e
def test_dry_run_without_cloud_access_says_why_and_prints_the_rest(tmp_path):
    env = {**os.environ, "SKY_RUNTIME_DIR": str(tmp_path), "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1: accelerate launch" in result.stdout
    assert "--- SkyPilot plan ---\nSkyPilot's task parser and schema: accepted\nnot computed: " in result.stdout


def test_launch_side_never_imports_the_training_stack():
    code = (
        "import sys\n"
        "from orchestrator.cli import main\n"
        "main(['run', 'phi3_dpo_fsdp', '--gpus', 'A100:8', '--nodes', '2', '--dry-run', '--skip-optimizer'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'sky', 'accelerate') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------- no surprise bills: show the price, then ask

CONFIRM = """
import sys
sys.path.insert(0, {tests!r})
import sky, sky.check, sky.clouds
sky.check.get_cached_enabled_clouds_or_refresh = lambda *a, **k: [sky.clouds.AWS()]
from fake_sky import FakeSky
fake = FakeSky(sky)
sys.modules["sky"] = fake  # SDK calls are recorded; SkyPilot's optimizer and task parser stay real
from orchestrator.cli import main
code = main(sys.argv[1:])
print("CALLS", [c[0] for c in fake.calls], flush=True)
raise SystemExit(code)
"""


def seeded_catalog(tmp_path) -> dict:
    catalogs = tmp_path / "runtime" / ".sky" / "catalogs" / "v8"
    (catalogs / "aws").mkdir(parents=True)
    (catalogs / "common").mkdir(parents=True)
    (catalogs / "aws" / "vms.csv").write_text(VMS_CSV)
    (catalogs / "common" / "accelerators.csv").write_text(ACCELERATORS_CSV)
    (catalogs / "common" / "metadata.csv").write_text(METADATA_CSV)
    return {**os.environ, "SKY_RUNTIME_DIR": str(tmp_path / "runtime"), "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1"}


def launch_in_a_terminal(project, env, answer: str, *argv: str):
    """Run `orch run ...` with a pseudo-terminal as stdin and type `answer` at the prompt."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", CONFIRM.format(tests=str(Path(__file__).parent)), "run", *argv],
        cwd=project, env=env, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(slave)
    os.write(master, answer.encode() + b"\n")
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(master)
    return proc.returncode, out, err


@pytest.mark.e2e
def test_launch_shows_plan_and_price_and_asks_first(project, tmp_path):
    env = seeded_catalog(tmp_path)
    argv = ("phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2")
    code, out, err = launch_in_a_terminal(project, env, "n", *argv)
    assert code == 1, out + err
    assert "[orch] phi3_dpo_fsdp: 2 node(s) x A100:8 as a cluster" in out
    assert re.search(r"\[orch\] checkpoints and final model: bucket orch-phi3-dpo-fsdp-[0-9a-f]{8} mounted at /", out)
    assert (
        "[orch] SkyPilot's plan: AWS us-east-1 p4d.24xlarge x 2 node(s), on-demand: $32.77/h per node, "
        "$65.55/h in all" in out
    )
    assert "estimated cost: EXPECTED_GPU_HOURS 40 / 16 GPUs = 2.50 h (ideal scaling) x $65.55/h = $163.86" in out
    assert "Launch? [y/N]" in out and "[orch] not launched" in out
    assert "CALLS []" in out and not (project / "sky_jobs").exists()  # nothing sent, nothing written

    code, out, err = launch_in_a_terminal(project, env, "y", *argv)
    assert code == 0, out + err
    assert "CALLS ['launch', 'tail_logs']" in out
    (record,) = (project / "sky_jobs").glob("*.yaml")
    envs = yaml.safe_load(record.read_text())["envs"]
    # the plan's price, and every region's for the head node to pick where failover really put it (node/price.py)
    assert envs["ORCH_PRICE_PER_HOUR"] == "65.5452"
    assert json.loads(envs["ORCH_PRICES"]) == {"AWS/us-east-1": 65.5452, "AWS/us-west-2": 70.0}


def test_non_interactive_launch_needs_yes(project):
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", "phi3_dpo_fsdp"],
        cwd=project, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "orch: error: a cloud launch asks before it spends money, but stdin is not a terminal: pass -y to launch"
    )
    assert not (project / "sky_jobs").exists()


def test_without_a_local_plan_the_api_servers_optimizer_is_asked(in_project, fake, monkeypatch, capsys):
    """No catalog or credentials here (a team's API server holds them): SkyPilot's optimizer runs there."""
    from orchestrator.launch.backends import sky as sky_backend

    monkeypatch.setattr(sky_backend, "optimize", lambda task: (_ for _ in ()).throw(sky_backend.OrchError("no cloud")))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt="": print(prompt) or "y")
    assert cli.main(["run", "phi3_dpo_fsdp", "--detach"]) == 0
    assert fake.names() == ["optimize", "launch"]
    assert "SkyPilot's plan and price: above (its optimizer, run by your API server)" in capsys.readouterr().out


def test_skypilots_optimizer_runs_while_the_launch_rehearses(in_project, fake, monkeypatch, capsys):
    """The plan is asked for before the rehearsal starts and taken after it, so the optimizer's seconds (catalogs, a
    Slurm cluster's inventory) pass while the rehearsal's process runs; its lines still come after the rehearsal's."""
    from orchestrator.launch import checks
    from orchestrator.launch.backends import sky as sky_backend

    planning = threading.Event()

    def optimize(task):
        planning.set()
        raise sky_backend.OrchError("no cloud here")

    def rehearse(launch, checked):  # returns only once the optimizer has started in its thread
        assert planning.wait(60), "the optimizer had not started while the launch rehearsed"
        return "rehearsal: stand-in"

    monkeypatch.setattr(sky_backend, "optimize", optimize)
    monkeypatch.setattr(checks, "rehearse", rehearse)
    monkeypatch.setenv("ORCH_REHEARSAL", "on")
    assert cli.main(["run", "phi3_dpo_fsdp", "--detach", "-y"]) == 0
    out = capsys.readouterr().out
    assert out.index("[orch] rehearsal: stand-in") < out.index("[orch] SkyPilot's plan: not computed here (no cloud here)")
    assert fake.names() == ["launch"]


def test_a_refused_rehearsal_does_not_wait_for_the_optimizer(in_project, fake, monkeypatch, capsys):
    """The rehearsal refuses while SkyPilot's optimizer is still working: orch stops at once with the rehearsal's
    line, sends nothing and writes no record; the optimizer's thread is a daemon, left to end on its own."""
    from orchestrator.launch import checks
    from orchestrator.launch.backends import sky as sky_backend

    started, release = threading.Event(), threading.Event()

    def optimize(task):
        started.set()
        release.wait(60)
        raise sky_backend.OrchError("no cloud here")

    def rehearse(launch, checked):
        assert started.wait(60)
        raise sky_backend.OrchError("rehearsal: trainer refused the launch: stand-in")

    monkeypatch.setattr(sky_backend, "optimize", optimize)
    monkeypatch.setattr(checks, "rehearse", rehearse)
    monkeypatch.setenv("ORCH_REHEARSAL", "on")
    try:
        assert cli.main(["run", "phi3_dpo_fsdp", "--detach", "-y"]) == 2
        assert not release.is_set()  # returned while the optimizer still worked
        assert [t.name for t in threading.enumerate() if t.name == "orch-skypilot-plan"] == ["orch-skypilot-plan"]
    finally:
        release.set()
    assert "rehearsal: trainer refused the launch: stand-in" in capsys.readouterr().err
    assert fake.names() == [] and not (in_project / "sky_jobs").exists()


def test_ctrl_c_while_following_stops_following_only(in_project, fake, capsys, monkeypatch):
    """A cloud run's job belongs to SkyPilot: Ctrl-C (or a closed terminal) while following the logs cancels
    nothing, and orch says how to follow it again or cancel it."""

    def interrupted(cluster_name, job_id, follow, **kw):
        fake.calls.append(("tail_logs", None, {"cluster_name": cluster_name}))
        raise KeyboardInterrupt

    monkeypatch.setattr(fake, "tail_logs", interrupted)
    code = cli.main(["run", "phi3_dpo_fsdp", "--cluster", "c1", "-y"])
    out = capsys.readouterr()
    assert code == 130
    assert fake.names() == ["launch", "tail_logs"]  # no cancel, no down
    (record,) = run_files(in_project)
    assert f"`orch logs {record.stem} --follow` follows it again" in out.out
    assert f"`orch cancel {record.stem}` cancels it" in out.out
    assert "# state: submitted" in record.read_text() and "# job_id: 7" in record.read_text()

    def logs_interrupted(name=None, job_id=None, follow=True, **kw):
        raise KeyboardInterrupt

    assert cli.main(["run", "phi3_dpo_fsdp", "--managed", "--detach", "-y"]) == 0
    managed = next(p for p in run_files(in_project) if "sky-managed" in p.read_text())
    monkeypatch.setattr(fake.jobs, "tail_logs", logs_interrupted)
    capsys.readouterr()
    assert cli.main(["logs", managed.stem, "--follow"]) == 130
    assert f"the job goes on (`orch cancel {managed.stem}` cancels it)" in capsys.readouterr().out
    assert "jobs.cancel" not in fake.names()


@pytest.mark.parametrize("where", ["launch", "interrupt"])
def test_a_failed_or_interrupted_submission_is_recorded_and_every_verb_answers(
    in_project, fake, capsys, monkeypatch, where
):
    def failing(task, cluster_name=None, **kw):
        if where == "interrupt":
            raise KeyboardInterrupt
        raise sky.exceptions.ResourcesUnavailableError("Failed to acquire resources in all zones of us-east-1")

    monkeypatch.setattr(fake, "launch", failing)
    code = cli.main(["run", "phi3_dpo_fsdp", "--cluster", "c2", "-y"])
    out = capsys.readouterr()
    (record,) = run_files(in_project)
    text = record.read_text()
    if where == "launch":
        assert code == 2
        (line,) = out.err.strip().splitlines()
        assert line.startswith("orch: error: SkyPilot launch (sky launch) failed: ResourcesUnavailableError")
        assert "no capacity or quota" in line
        assert "# state: failed to launch" in text and "Failed to acquire resources" in text
    else:
        assert code == 130
        assert "# state: interrupted while launching" in text and f"`orch down {record.stem}`" in out.out
    assert cli.main(["status"]) == 0
    assert record.stem in capsys.readouterr().out
    for verb in ("logs", "cancel"):
        assert cli.main([verb, record.stem]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "has no job id" in line and f"`orch down {record.stem}`" in line
    assert cli.main(["down", record.stem]) == 0
    assert fake.names()[-1] == "down" and "cancel" not in fake.names()


def test_a_cost_cap_without_a_price_is_refused_before_anything_is_sent(in_project, fake, capsys):
    code = cli.main(["run", "phi3_dpo_fsdp", "--cluster", "c3", "--max-cost", "500", "-y"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.startswith("orch: error: --max-cost needs the cluster's price")
    assert "--env ORCH_PRICE_PER_HOUR=" in line and fake.names() == [] and run_files(in_project) == []
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "c3", "--max-cost", "500", "--env",
                     "ORCH_PRICE_PER_HOUR=65.5", "--detach", "-y"]) == 0  # fmt: skip
    _, task, _ = fake.calls[0]
    assert task.envs["ORCH_MAX_COST"] == "500" and task.envs["ORCH_PRICE_PER_HOUR"] == "65.5"


def test_a_launched_cluster_stops_by_itself_unless_asked(in_project, fake, capsys):
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "a1", "--detach", "-y"]) == 0
    assert fake.calls[-1][2]["idle_minutes_to_autostop"] == 10 and fake.calls[-1][2]["down"] is False
    assert "[orch] cluster a1: stops by itself after 10 idle minutes (autostop" in capsys.readouterr().out
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "a2", "--detach", "--keep-up", "-y"]) == 0
    assert fake.calls[-1][2]["idle_minutes_to_autostop"] is None
    assert "kept up after the job (--keep-up)" in capsys.readouterr().out
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "a3", "--keep-up", "--down", "-y"]) == 2
    assert "--keep-up keeps the cluster up" in capsys.readouterr().err


def test_status_marks_an_idle_cluster_and_its_price(in_project, fake, capsys):
    class Resources:
        def get_cost(self, seconds):
            return 32.77 * seconds / 3600

    handle = type("Handle", (), {"launched_resources": Resources(), "launched_nodes": 2})()
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "idle1", "--detach", "-y"]) == 0
    fake.clusters = [{"status": "ClusterStatus.UP", "handle": handle, "autostop": 10, "to_down": False}]
    fake.cluster_jobs = [{"job_id": 7, "status": "JobStatus.SUCCEEDED"}]
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    assert "cluster UP, IDLE at $65.54/h (stops after 10 idle min)" in capsys.readouterr().out
    fake.clusters[0]["autostop"] = -1
    assert cli.main(["status"]) == 0
    assert "no autostop: `orch down " in capsys.readouterr().out


def test_status_refreshes_one_run_from_skypilots_logs_and_lists_from_records(in_project, fake, capsys):
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "prog1", "--detach", "-y"]) == 0
    (record,) = run_files(in_project)
    fake.log_text = (
        "(head, rank=0, pid=1) [orch] step 40/400 loss=0.6931 grad_norm=1.2 learning_rate=1e-06 | 12,345 tok/s | "
        "MFU 41.0% | elapsed 5m00s | ETA 45m00s | $5.46 spent, $54.60 at the end\n"
        "(head, rank=0, pid=1) [orch] step 41/400 loss=0.6812 grad_norm=1.1 learning_rate=1e-06 "
        "rewards/accuracies=0.625 rewards/margins=0.04117 | 12,400 tok/s | "  # DPO's headline metrics (core/trainers)
        "elapsed 5m07s | ETA 44m53s | $5.60 spent, $54.60 at the end\n(head, rank=0, pid=1) saving...\n"
    )
    capsys.readouterr()
    assert cli.main(["status", record.stem[:12]]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:9] == ["RUN", "BACKEND", "STATE", "STEP", "LOSS", "METRIC", "TOK/S", "ETA", "SPENT"]
    for cell in ("cluster UP", " 41/400 ", " 0.6812 ", " rewards/accuracies=0.625 ", " 12,400 ", " 44m53s ", " $5.60 "):
        assert cell in row, (cell, row)
    assert ("tail_logs", None, {"cluster_name": "prog1", "job_id": 7, "follow": False}) in fake.calls
    text = record.read_text()
    assert "# step: 41/400" in text and "# spent: $5.60" in text and "# metric: rewards/accuracies=0.625" in text
    # the listing answers from the record; a run known to be over is not asked about again
    record.write_text(text.replace("# state: cluster UP", "# state: SUCCEEDED"))
    fake.calls.clear()
    assert cli.main(["status"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert " SUCCEEDED " in row and " 41/400 " in row and " rewards/accuracies=0.625 " in row and fake.calls == []



def test_status_asks_skypilot_about_every_live_run_at_once(in_project, fake, capsys):
    """A live cluster run's state and its logs are each a request to the cluster (~2 s each on the SkyPilot bed):
    `orch status` asks about all its live runs at once, and `orch status RUN` asks for the logs beside the state.
    Here each answer waits until the other has been asked: asked one after the other, neither would come in 10 s."""
    import threading

    for name in ("c-one", "c-two"):
        assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", name, "--detach", "-y"]) == 0
    capsys.readouterr()

    def meeting(*answers):  # the answers, each held until two calls of them have come
        meet = threading.Barrier(2, timeout=10)
        return [lambda *args, _answer=answer, **kw: (meet.wait(), _answer(*args, **kw))[1] for answer in answers]

    real_status, real_queue, real_logs = fake.status, fake.queue, fake.tail_logs
    (fake.status,) = meeting(real_status)  # the two runs' states
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.count(" cluster UP ") == 2 and "unavailable" not in out, out
    fake.status = real_status
    fake.queue, fake.tail_logs = meeting(real_queue, real_logs)  # one run's job queue and its logs
    first = run_files(in_project)[0].stem
    assert cli.main(["status", first]) == 0
    out = capsys.readouterr().out
    assert " cluster UP " in out and "unavailable" not in out, out

@pytest.mark.e2e
def test_dry_run_places_and_recovers_in_skypilots_spellings(tmp_path):
    """The task SkyPilot's own parser accepts, with infra, network_tier and job_recovery; and
    a data file of the user's travels as a file mount TRL reads."""
    env = {**os.environ, "SKY_RUNTIME_DIR": str(tmp_path), "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1", "HF_TOKEN": "x"}
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    argv = ["run", "llama3_sft_fsdp", "--gpus", "H100:8", "--nodes", "2", "--infra", "k8s", "--network-tier", "best",
            "--managed", "--dry-run", "--secret", "HF_TOKEN", "--image-id", "docker:nvcr.io/nvidia/pytorch:25.01-py3",
            "--data", str(mine)]
    result = subprocess.run([sys.executable, "-m", "orchestrator", *argv], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    shown = result.stdout.split("--- resolved task (what sky_jobs/<run>.yaml will hold) ---\n")[1].split("\n--- ")[0]
    task = sky.Task.from_yaml_config(yaml.safe_load(shown))  # SkyPilot's own parser
    (resources,) = list(task.resources)
    assert str(resources.cloud) == "Kubernetes" and resources.network_tier.value == "best"
    assert {k: v for k, v in resources.job_recovery.items() if v is not None} == {
        "max_restarts_on_errors": 3, "recover_on_exit_codes": [75]}  # as SkyPilot parsed it
    assert resources.image_id and "nvcr.io/nvidia/pytorch:25.01-py3" in str(resources.image_id)
    assert "infra: k8s" in shown and "network_tier: best" in shown and "job_recovery:" in shown
    assert "SkyPilot's task parser and schema: accepted" in result.stdout
    assert task.file_mounts["/orch-data/train.jsonl"] == str(mine)
    assert "dataset_name=/orch-data dataset_train_split=train" in task.envs["TRL_OVERRIDES"]
    bad = subprocess.run([sys.executable, "-m", "orchestrator", *argv[:7], "nowhere/x", *argv[8:]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("orch: error: SkyPilot rejects the task:")
    assert "$.infra" in bad.stderr and "--- resolved task" not in bad.stdout


@pytest.mark.e2e
def test_orch_plan_prices_nodes_from_skypilots_catalog_on_this_machine(tmp_path):
    """$/h per node count from SkyPilot's own catalog reader (list_accelerators) over the catalog files present here:
    8 x A100 nodes at p4d.24xlarge's $32.77/h, times the nodes the estimate needs; no file, no price, said so."""
    env = seeded_catalog(tmp_path)
    argv = [sys.executable, "-m", "orchestrator", "plan", "meta-llama/Llama-3.1-8B-Instruct", "--max-length", "2048"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:] if line.strip()}
    a100 = rows["A100"]
    nodes = int(a100[1])
    assert a100[7] == f"{32.7726 * nodes:.2f}" and a100[8:10] == ["AWS", "p4d.24xlarge"], a100
    assert rows["A10G"][8:10] == ["AWS", "g5.48xlarge"] and rows["H100"][7] == "-"  # no H100 row in this catalog
    assert "SkyPilot's catalog is not on this machine" not in result.stdout
    bare = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "SKY_RUNTIME_DIR": str(tmp_path / "empty")})  # fmt: skip
    assert "$/h: SkyPilot's catalog is not on this machine" in bare.stdout, bare.stdout


def test_a_cpu_slurm_launch_drops_the_bucket_and_smokes_on_the_nodes(in_project, fake, capsys):
    """`orch run ... --infra slurm/NAME --gpus none --smoke`: CPU nodes (no accelerator asked for), the tiny model
    built on the nodes (ORCH_SMOKE), and checkpoints on the cluster's shared home instead of a bucket no Slurm
    cluster can mount (as scripts/on-slurm.py prints for plain `sky launch`)."""
    argv = ["run", "phi3_dpo_fsdp", "--infra", "slurm/bed", "--nodes", "2", "--gpus", "none", "--smoke", "--detach",
            "-y", "--no-rehearsal"]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err
    _, task, kw = fake.calls[0]
    # SkyPilot cannot stop a Slurm allocation (autostop needs a Pyxis container): the idle cluster is torn down
    assert (kw["idle_minutes_to_autostop"], kw["down"]) == (10, True)
    assert "its Slurm allocation ends after 10 idle minutes" in capsys.readouterr().out
    (resources,) = list(task.resources)
    assert not resources.accelerators and str(resources.cloud) == "Slurm"
    assert not task.storage_mounts and not task.file_mounts
    assert task.envs["CHECKPOINT_ROOT"] == "~/orch-checkpoints" and "CHECKPOINT_BUCKET" not in task.envs
    assert (task.envs["ORCH_DEVICE"], task.envs["ORCH_GPUS_PER_NODE"], task.envs["ORCH_SMOKE"]) == ("cpu", "1", "on")
    (record,) = run_files(in_project)
    assert "file_mounts" not in yaml.safe_load(record.read_text())


@pytest.mark.parametrize("history", [["NotSupportedError"], ["ResourcesUnavailableError", "NotSupportedError"], []])
def test_a_failed_provisioning_quotes_its_first_failure_that_was_not_about_capacity(history):
    # Through the API server the error comes back by SkyPilot's own (de)serializer, failover history included.
    from sky import exceptions

    from orchestrator.launch.backends.sky import sdk_error

    causes = {
        "NotSupportedError": exceptions.NotSupportedError(
            "The following features are not supported by Slurm:\n\tFeature Reason\n\tautostop  Autostop is "
            "supported only for container clusters on Slurm clusters with Pyxis installed."
        ),
        "ResourcesUnavailableError": exceptions.ResourcesUnavailableError("No capacity in us-east-1a"),
    }
    raised = exceptions.ResourcesUnavailableError(
        "Failed to provision all possible launchable resources.", failover_history=[causes[n] for n in history]
    )
    came = exceptions.deserialize_exception(exceptions.serialize_exception(raised))
    line = str(sdk_error("launch (sky launch)", came))
    assert "\n" not in line
    if "NotSupportedError" in history:
        assert line.startswith("SkyPilot launch (sky launch) failed: NotSupportedError: The following features are not "
                               "supported by Slurm: Feature Reason autostop Autostop is supported only for container")  # fmt: skip
        assert "no capacity" not in line and "lacks a feature" in line
    else:
        assert line.startswith("SkyPilot launch (sky launch) failed: ResourcesUnavailableError: Failed to provision")
        assert "no capacity or quota" in line


def test_resume_relaunches_the_recorded_task_under_the_same_run_id(in_project, fake, capsys, monkeypatch):
    """`orch run --resume RUN` sends the recorded task again, unchanged, to the run's cluster: ORCH_RUN_ID (the run's
    name) keys the checkpoints, so the trainer finds its last one; the record is the same file with the new job id."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["run", "phi3_dpo_fsdp", "--nodes", "2", "--secret", "HF_TOKEN", "--cluster", "c1", "-y"]) == 0
    (record,) = run_files(in_project)
    run = record.stem
    _, first, _ = fake.calls[0]
    assert first.envs["ORCH_RUN_ID"] == run
    # still running: refused, nothing sent
    capsys.readouterr()
    assert cli.main(["run", "--resume", run, "-y"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"orch: error: run {run} is cluster UP: `orch cancel {run}` stops it first (its last checkpoint is " \
                   f"kept), `orch logs {run} --follow` follows it"  # fmt: skip
    assert cli.main(["cancel", run]) == 0
    fake.calls.clear()
    assert cli.main(["run", "--resume", run, "-y", "--detach"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"[orch] run {run}: relaunch 1, resuming from its last checkpoint (/checkpoints/{run})" in out
    (name, again, kw) = fake.calls[0]
    assert name == "launch" and kw["cluster_name"] == "c1" and (kw["idle_minutes_to_autostop"], kw["down"]) == (10, False)
    # the same task; only the submission's time (for the node's time-to-first-step line) is the relaunch's own
    sent = [{k: v for k, v in t.envs.items() if k != "ORCH_LAUNCHED_AT"} for t in (first, again)]
    assert sent[0] == sent[1] and again.secrets["HF_TOKEN"].get_secret_value() == SECRET
    assert float(first.envs["ORCH_LAUNCHED_AT"]) <= float(again.envs["ORCH_LAUNCHED_AT"]) <= time.time()
    assert [r.accelerators for r in again.resources] == [r.accelerators for r in first.resources]
    assert again.num_nodes == 2
    text = record.read_text()
    assert "# relaunches: 1" in text and "# job_id: 7" in text and "# state: submitted" in text
    assert SECRET not in text and run_files(in_project) == [record]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["phi3_dpo_fsdp"], "drop the recipe"),
        (["lr=1e-5"], "drop key=value words"),
        (["--spot", "--nodes", "4"], "drop --spot"),
        (["--local"], "drop --local"),
        (["--env", "A=1", "--managed"], "drop --env, --managed"),
        (["--secret", "WANDB_API_KEY=x"], "--secret WANDB_API_KEY: the recorded run has no such secret (it has HF_TOKEN)"),
        (["--keep-up", "--down"], "--keep-up keeps the cluster up"),
    ],
)
def test_resume_refuses_what_would_change_the_run(in_project, fake, capsys, monkeypatch, argv, says):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["run", "phi3_dpo_fsdp", "--secret", "HF_TOKEN", "-y"]) == 0
    (record,) = run_files(in_project)
    assert cli.main(["cancel", record.stem]) == 0
    before, calls = record.read_text(), len(fake.calls)
    capsys.readouterr()
    assert cli.main(["run", "--resume", record.stem, "-y", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert says in line, line
    assert record.read_text() == before and len(fake.calls) == calls


def test_resume_at_another_shape_checks_it_and_keeps_the_run_id(in_project, fake, capsys, monkeypatch):
    """`orch run --resume RUN --nodes M --gpus ACC:N`: the recorded task at the new shape, checked there first (a
    shape that breaks the global batch is refused naming the shapes that keep it, nothing sent), sent to a cluster of
    its own under the same ORCH_RUN_ID: the nodes resume the checkpoint and reshard it (train/reshape.py)."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["run", "phi3_dpo_fsdp", "--nodes", "2", "--secret", "HF_TOKEN", "--cluster", "c1", "-y"]) == 0
    (record,) = run_files(in_project)
    run = record.stem
    assert cli.main(["cancel", run]) == 0
    before, calls = record.read_text(), len(fake.calls)
    capsys.readouterr()
    assert cli.main(["run", "--resume", run, "--nodes", "3", "-y"]) == 2  # 24 ranks: 64 is not a multiple
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("at this per-device batch these shapes keep it: 1 or 2 node(s) x 8 (--nodes)"), line
    assert record.read_text() == before and len(fake.calls) == calls

    assert cli.main(["run", "--resume", run, "--nodes", "1", "--gpus", "H100:8", "-y", "--detach"]) == 0
    out = capsys.readouterr().out
    assert f"[orch] run {run}: relaunch on 1 x H100:8 (recorded: 2 x A100:8); the nodes resume its last checkpoint" in out
    (name, sent, kw) = fake.calls[-1]
    assert name == "launch" and sent.num_nodes == 1 and kw["cluster_name"] == f"{run}-1xh1008"[:63]
    assert [str(r.accelerators) for r in sent.resources] == ["{'H100': 8}"]
    assert sent.envs["ORCH_RUN_ID"] == run and sent.secrets["HF_TOKEN"].get_secret_value() == SECRET
    text = record.read_text()
    assert "num_nodes: 1" in text and "accelerators: H100:8" in text and f"# cluster: {run}-1xh1008" in text
    assert "# relaunches: 1" in text and SECRET not in text


def test_resume_refuses_a_run_keyed_by_skypilots_task_id_and_a_local_run(in_project, fake, capsys):
    assert cli.main(["run", "phi3_dpo_fsdp", "-y"]) == 0
    (record,) = run_files(in_project)
    assert cli.main(["cancel", record.stem]) == 0
    record.write_text(record.read_text().replace(f"ORCH_RUN_ID: {record.stem}\n", ""))  # a record from before
    capsys.readouterr()
    assert cli.main(["run", "--resume", record.stem, "-y"]) == 2
    assert "keyed its checkpoints by SkyPilot's task id" in capsys.readouterr().err
    assert cli.main(["run", "--resume", "no-such-run", "-y"]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err
    assert cli.main(["run", "phi3_dpo_fsdp", "--env", "ORCH_RUN_ID=mine", "-y"]) == 2
    assert "--env ORCH_RUN_ID: orch sets it to the run's name" in capsys.readouterr().err


def test_a_cluster_skypilot_prices_at_zero_sends_no_price():
    """SkyPilot plans a Slurm (or Kubernetes) cluster of one's own at $0/h; the nodes take ORCH_PRICE_PER_HOUR as a price
    > 0 only, so a $0 plan sends none (the bed's `orch run -y` failed its setup on ORCH_PRICE_PER_HOUR='0.0000')."""
    from types import SimpleNamespace

    from orchestrator.launch import placement
    from orchestrator.launch.backends.sky import PlanResult

    free = PlanResult(cloud="Slurm", region="orch-bed", instance_type="2CPU--3GB", use_spot=False,
                      node_dollars_per_hour=0.0, nodes=2)  # fmt: skip
    launch = SimpleNamespace(envs={"GLOBAL_BATCH_SIZE": "16"}, replace=lambda **kw: pytest.fail(f"priced: {kw}"))
    assert placement.priced(launch, free) is launch


JUNK = [  # a file under each of .gitignore's patterns, as a working checkout has them
    ".venv/bin/python", "orchestrator/__pycache__/cli.cpython-311.pyc", "orch.egg-info/PKG-INFO", ".pytest_cache/v",
    ".ruff_cache/x", ".mypy_cache/3.11/x.json", ".hypothesis/examples/x", "outputs/run/model.safetensors",
    "build/lib/x.py", "sky_jobs/phi3-dpo-fsdp-1.yaml", "sky_jobs/.locks/phi3", "bench/run.tmp", "bench/.cache/x",
    "dist/orch-0.1.0-py3-none-any.whl",
]  # fmt: skip


def test_skypilot_uploads_what_git_would_and_leaves_out_git_itself(tmp_path):
    """The workdir every node gets: SkyPilot's client zips it for the API server and rsync copies it to the nodes, each
    reading .skyignore (which replaces .gitignore for SkyPilot): both must give exactly what git does not ignore (a
    file of the user's own included), without .git's history or the laptop's run records."""
    from sky.data import storage_utils
    from sky.utils import command_runner

    repo = tmp_path / "repo"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in [*tracked, ".skyignore"]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    for name in [*JUNK, "data/mine.jsonl"]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("x")
    git = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=repo, capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    expected = set(git) - {"sky_jobs/README.md"}
    assert "data/mine.jsonl" in expected and not expected & set(JUNK)
    assert any((repo / ".git").rglob("*")), "git init made no .git to leave out"

    archive = tmp_path / "workdir.zip"
    storage_utils.zip_files_and_folders([str(repo)], archive, relative_to_items=True)
    with zipfile.ZipFile(archive) as zipped:
        uploaded = {n.removeprefix("repo/") for n in zipped.namelist() if not n.endswith("/")}
    assert uploaded == expected, (sorted(uploaded - expected)[:10], sorted(expected - uploaded)[:10])

    rsync = f"rsync -an --out-format=%n {command_runner.RSYNC_FILTER_SKYIGNORE} {repo}/ {tmp_path / 'node'}/"
    listed = subprocess.run(rsync, shell=True, capture_output=True, text=True, check=True).stdout.split()
    synced = {n for n in listed if not n.endswith("/")}
    assert synced == expected, (sorted(synced - expected)[:10], sorted(expected - synced)[:10])


def _folded_script(setup: str, run: str) -> str:
    from orchestrator.launch.resolved import fold_setup

    task = fold_setup({"num_nodes": 2, "setup": setup, "run": run})
    assert "setup" not in task
    return task["run"]


@pytest.mark.parametrize(
    ("setup", "code", "says"),
    [
        ("echo set up on $SKYPILOT_SETUP_NODE_RANK of $SKYPILOT_SETUP_NUM_GPUS_PER_NODE; X=1", 0,
         "set up on 1 of 4\nrun: X= setup-rank=\n"),  # the setup's names as SkyPilot's setup stage has them; its
        # variables and SkyPilot's setup-stage names do not reach the run
        ("echo early; exit 0\necho never", 0, "early\nrun: X= setup-rank=\n"),  # an `exit 0` ends the setup only
        ("echo broken; exit 3", 3, "broken\n"),  # a failed setup: the run never starts, its code is the job's
        ("false\necho after a failure the setup goes on, as its own stage would", 0,
         "after a failure the setup goes on, as its own stage would\nrun: X= setup-rank=\n"),
        ("cat <<'END'\n(a heredoc at the end)\nEND", 0, "(a heredoc at the end)\nrun: X= setup-rank=\n"),
    ],
)  # fmt: skip
def test_orch_run_starts_its_run_with_the_setup_as_its_own_stage_would_run(setup, code, says):
    """`orch run` sends the recipe's setup at the start of its run (one SkyPilot stage fewer): under bash, with the
    run's SkyPilot variables, it behaves as SkyPilot's setup stage would."""
    script = _folded_script(setup, 'echo "run: X=${X:-} setup-rank=${SKYPILOT_SETUP_NODE_RANK:-}"')
    env = {"PATH": os.environ["PATH"], "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2",
           "SKYPILOT_NUM_GPUS_PER_NODE": "4"}  # fmt: skip
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (code, says), done.stderr


def test_orch_run_sends_and_records_the_setup_inside_the_run(in_project, fake, capsys):
    from orchestrator.launch.recipe import load
    from orchestrator.launch.resolved import FOLD_HEAD

    assert cli.main(["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "-y"]) == 0
    _, task, _ = fake.calls[0]
    recipe = load("phi3_dpo_fsdp").task
    assert task.setup is None and task.run.startswith(FOLD_HEAD)
    assert recipe["setup"].strip() in task.run and task.run.endswith(recipe["run"])
    (record,) = run_files(in_project)
    recorded = sky.Task.from_yaml(str(record))  # the record is what was sent: `sky launch` of it does the same
    assert recorded.setup is None and recorded.run == task.run
    capsys.readouterr()
    assert cli.main(["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run", "--skip-optimizer"]) == 0
    shown = capsys.readouterr().out
    assert FOLD_HEAD.strip() in shown and "\nsetup:" not in shown  # the dry run shows what is sent


FAILED_JOB = (ROOT / "tests" / "fixtures" / "sky_logs" / "failed_job.log").read_text()
"""A real SkyPilot stream of a failed job, as `tail_logs(follow=True)` gave it to orch on the Slurm bed (2026-11-29):
rank 1 left training at step 3 (tests/fixtures/rank_fault, TEST_RANK_FAULT=exit), node 1's verdict names it, the head
node's rank saw a reset connection and was then cancelled by Slurm before its own verdict; SkyPilot ends with its job
driver's `Job 1 failed with return code list: [143]`."""
RANK1_LEFT = ("orch: error: rank 1 (node 1) exited with code 0 at step 3, before training ended (a sys.exit or return "
              "in the training code?): the other ranks then lose it in their next collective")  # fmt: skip


def test_a_followed_job_that_failed_ends_with_its_first_real_error(in_project, fake, capsys):
    """`orch run` without --detach (and `orch logs RUN`) end a failed job's stream with orch's line quoting the node's
    first real error, not SkyPilot's summary, and exit as the failing node did (1); the record keeps the line."""
    fake.log_text, fake.log_code = FAILED_JOB, 100  # sky.exceptions.JobExitCode.FAILED
    code = cli.main(["run", "phi3_dpo_fsdp", "--cluster", "f1", "-y"])
    out = capsys.readouterr().out
    (record,) = run_files(in_project)
    line = f"[orch] run {record.stem}: SkyPilot's job 7 on cluster f1 failed: {RANK1_LEFT}"
    assert code == 1 and out.rstrip().splitlines()[-1] == line, out[-2000:]
    assert f"# error: SkyPilot's job 7 on cluster f1 failed: {RANK1_LEFT}" in record.read_text()
    assert "# state: submitted" in record.read_text()  # SkyPilot's to say (the cluster may still be up, and billed)
    fake.cluster_jobs = [{"job_id": 7, "status": "JobStatus.FAILED"}]
    assert cli.main(["status", record.stem]) == 0  # the run's state from SkyPilot, and why it failed from its record
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"error: SkyPilot's job 7 on cluster f1 failed: {RANK1_LEFT}"
    # a relaunch that succeeds leaves no error behind
    fake.log_text, fake.log_code = "(head, rank=0, pid=1) [orch] step 8/8 loss=0.69\n", 0
    assert cli.main(["run", "--resume", record.stem, "-y"]) == 0
    assert "# error:" not in record.read_text() and "# relaunches: 1" in record.read_text()
    fake.log_text, fake.log_code = FAILED_JOB, 100
    assert cli.main(["logs", record.stem]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == line
    # the logs of a job still running, asked without --follow: what was asked, said as such
    fake.log_text, fake.log_code = "(head, rank=0, pid=1) [orch] step 3/8 loss=0.69\n", 101
    assert cli.main(["logs", record.stem]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == (
        f"[orch] run {record.stem}: SkyPilot's job 7 on cluster f1 is still running; `orch logs {record.stem} "
        "--follow` follows it")  # fmt: skip


def test_the_status_of_a_detached_job_that_failed_says_why(in_project, fake, capsys):
    """`orch status RUN` reads the job's last log lines beside its state: a detached job that failed gets the line a
    followed one would have ended with, in its record and under the table."""
    assert cli.main(["run", "phi3_dpo_fsdp", "--cluster", "f2", "--detach", "-y"]) == 0
    (record,) = run_files(in_project)
    fake.log_text, fake.log_code = FAILED_JOB, 100
    fake.cluster_jobs = [{"job_id": 7, "status": "JobStatus.FAILED"}]
    capsys.readouterr()
    assert cli.main(["status", record.stem]) == 0
    error = f"SkyPilot's job 7 on cluster f2 failed: {RANK1_LEFT}"
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"error: {error}"
    assert f"# error: {error}" in record.read_text()
    fake.log_text = "(head, rank=0, pid=1) [orch] step 3/8 loss=0.69\n"  # the error scrolled out of the last lines
    assert cli.main(["status", record.stem]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == (
        f"error: SkyPilot's job 7 on cluster f2 failed (no error line among its log's last lines: `orch logs "
        f"{record.stem}`)")  # fmt: skip


def _stream(*lines: str) -> str:
    return "".join(f"\x1b[36m({who})\x1b[0m {text}\n" if who else f"{text}\n" for who, text in lines)


HEAD, WORKER = "head, rank=0, pid=5576", "worker1, rank=1, pid=5637, ip=10.213.1.3"
NET = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.3]:20616: Connection reset by peer"


@pytest.mark.parametrize(
    "log, sky_code, exits, says",
    [
        # the node whose error is its own comes first, whichever node spoke first
        (_stream((HEAD, f"[rank0]: {NET}"),
                 (HEAD, f"[orch] failed on node 0: a network or GPU failure (accelerate exited with code 1, orch exits "
                        f"75, retryable): {NET}"),
                 (WORKER, "[rank1]: ValueError: the batch has no input_ids"),
                 (WORKER, "[orch] failed on node 1: accelerate exited with code 1: ValueError: the batch has no "
                          "input_ids"),
                 ("", "ERROR: \x1b[31mJob 1 failed with return code list:\x1b[0m [75, 1]")),
         100, 1, "failed: ValueError: the batch has no input_ids"),
        # every node lost the network: the cluster's failure, retryable (75) as each node said
        (_stream((HEAD, f"[orch] failed on node 0: a network or GPU failure (accelerate exited with code 1, orch exits "
                        f"75, retryable): {NET}"),
                 (WORKER, "[orch] failed on node 1: a network or GPU failure (accelerate exited with code 1, orch exits "
                          "75, retryable): RuntimeError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, remote process "
                          "exited or there was a network error")),
         100, 75, f"failed: {NET}"),
        # a setup that failed (no node got to training): node-setup.sh's own error line
        (_stream((HEAD, "[orch] setup: installing uv.lock's orch[train] (73 packages)"),
                 (HEAD, "orch: error: uv could not install uv.lock: no space left on device (/home/u/.cache/uv)"),
                 ("", "ERROR: Job 1's setup failed with return code 1 (pid=2041).")),
         100, 1, "failed: orch: error: uv could not install uv.lock: no space left on device (/home/u/.cache/uv)"),
        # the head's verdict names the rank that left (its own network error quoted after it): that rank, exit 1
        (_stream((HEAD, f"[rank0]: {NET}"),
                 (HEAD, "[orch] failed on node 0: accelerate exited with code 1: orch: error: rank 1 (node 1) exited "
                        f"with code 0 at step 3, before training ended (this node then saw: {NET})")),
         100, 1, f"failed: orch: error: rank 1 (node 1) exited with code 0 at step 3, before training ended (this node "
                 f"then saw: {NET})"),
        # a stall the watchdog ended: the node exits 75 (retryable), and so does orch
        (_stream((WORKER, "orch: error: stalled on node 1: no step for 300 s (10 x the median step time 2.1 s); "
                          "rank 1: in all_reduce"),),
         100, 75, "failed: orch: error: stalled on node 1: no step for 300 s (10 x the median step time 2.1 s); "
                  "rank 1: in all_reduce"),
        # nothing to quote: said so, never SkyPilot's summary
        (_stream(("", "ERROR: Job 1 failed with return code list: [137]")), 100, 1,
         "failed (its log above quotes no error line)"),
        (_stream((HEAD, "[orch] step 3/8 loss=0.69")), 103, 1, "was cancelled"),
        (_stream((HEAD, "[orch] step 8/8 loss=0.69")), 0, 0, None),
    ],
    ids=["own-error-first", "network-everywhere", "setup-failed", "rank-left", "stalled", "no-error-line", "cancelled",
         "succeeded"],
)  # fmt: skip
def test_a_followed_jobs_end_is_one_line_and_orchs_exit_code(in_project, fake, capsys, log, sky_code, exits, says):
    fake.log_text, fake.log_code = log, sky_code
    assert cli.main(["run", "phi3_dpo_fsdp", "--managed", "-y"]) == exits
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    (record,) = run_files(in_project)
    if says is None:
        assert not last.startswith(f"[orch] run {record.stem}:"), last
    else:
        assert last == f"[orch] run {record.stem}: SkyPilot's managed job 42 {says}", last


def test_the_streams_lines_are_read_across_writes_and_passed_on_unchanged():
    """SkyPilot writes the stream as it comes (a line in pieces, a progress bar's carriage returns): every byte goes
    on to the terminal as it came, and lines are read whole."""
    import io

    from orchestrator.launch.job_end import Follow, ended

    sink = io.StringIO()
    follow = Follow(sink)
    for piece in (FAILED_JOB[:1000], FAILED_JOB[1000:1001], FAILED_JOB[1001:]):
        follow.write(piece)
        follow.flush()
    assert sink.getvalue() == FAILED_JOB
    assert ended(100, follow, "r1", "job 1") == (1, f"[orch] run r1: job 1 failed: {RANK1_LEFT}")


def test_a_nodes_verdict_is_read_back_as_it_was_written():
    from orchestrator.node.output import VERDICT, verdict

    for error in ("", "ValueError: x: y", "orch: error: rank 1 left (this node then saw: RuntimeError: reset)"):
        for exits in (None, 75):
            match = VERDICT.match(verdict(3, 1, error, exits))
            assert match and match["node"] == "3" and match["code"] == "1", (error, exits)
            assert (match["error"] or "", match["exits"]) == (error, None if exits is None else "75")


@pytest.mark.unit
def test_a_path_the_nodes_read_must_lie_in_the_upload(project, monkeypatch):
    """A cloud run's ranks read a relative model, dataset, chat template or checkpoint from the workdir SkyPilot
    uploaded (launch/node_paths.py): one written as a path that is missing, outside the workdir or left out of the
    upload stopped the nodes after provisioning (the rehearsal swaps model and data, so it could not tell)."""
    from orchestrator.core.errors import OrchError
    from orchestrator.launch import node_paths
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.resolved import resolve

    monkeypatch.chdir(project)
    (project / ".skyignore").write_text("# local runs\noutputs/\n/build/*.tmp\n")
    for folder in ("outputs/run-1/checkpoint-4", "models/mine", "build/x.tmp"):
        (project / folder).mkdir(parents=True)
    (project / "chat.jinja").write_text("{{ messages }}")
    phi3 = recipes.load("recipes/phi3_dpo_fsdp.yaml")

    def judged(**settings):
        return node_paths.check(resolve(phi3, trl_overrides=settings))

    refused = {
        "model_name_or_path=./mine": "model_name_or_path=./mine: no such file or directory in the workdir",
        "model_name_or_path=outputs/run-1/checkpoint-4": "model_name_or_path=outputs/run-1/checkpoint-4: outputs is "
        "left out of the workdir's upload (.skyignore: outputs), so the nodes would not have it",
        "resume_from_checkpoint=./build/x.tmp": "build/x.tmp is left out of the workdir's upload (.skyignore: "
        "build/*.tmp)",
        "dataset_name=../elsewhere": f"dataset_name=../elsewhere: outside the workdir ({project}), which is all "
        "SkyPilot uploads to the nodes",
        "chat_template_path=chats.jinja": "chat_template_path=chats.jinja: no such file or directory in the workdir",
    }
    for given, said in refused.items():
        key, value = given.split("=", 1)
        with pytest.raises(OrchError, match=re.escape(said)):
            judged(**{key: value})
    # in the upload, a Hub id, a path of the nodes' own (a mount, the image) or their home: taken
    assert judged(model_name_or_path="./models/mine", chat_template_path="chat.jinja") == []
    assert judged(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/Capybara") == []
    assert judged(resume_from_checkpoint="/checkpoints/run/checkpoint-8", model_name_or_path="~/merged") == []
    assert judged(model_name_or_path=str(project / "models" / "mine")) == [
        f"[orch] note: model_name_or_path={project / 'models' / 'mine'} is a path on this machine and under none of "
        "the task's mounts: the nodes read it from their own disks"
    ]


@pytest.mark.unit
def test_what_the_upload_takes_is_asked_of_rsync_with_skypilots_filter(project, monkeypatch, tmp_path_factory):
    """SkyPilot uploads the workdir with rsync and a dir-merge filter (every folder's .gitignore, .git/info/exclude;
    or .skyignore) and copies a link as a link: rsync itself is asked (node_paths.uploaded), so a file a nested
    .gitignore leaves out, a pattern in .git/info/exclude, or a folder that is a link to outside the workdir is refused,
    and a top-level pattern anchored with / does not refuse a folder of that name deeper down."""
    from orchestrator.core.errors import OrchError
    from orchestrator.launch import node_paths
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.resolved import resolve

    monkeypatch.chdir(project)
    (project / ".gitignore").write_text("/outputs\n")
    (project / ".git" / "info").mkdir(parents=True)
    (project / ".git" / "info" / "exclude").write_text("scratch/\n")
    for folder in ("data/chats", "data/raw", "scratch/model", "recipes/outputs/model"):
        (project / folder).mkdir(parents=True)
    (project / "data" / "chats" / "train.jsonl").write_text("{}\n")
    (project / "data" / "chats" / "huge.jsonl").write_text("{}\n")
    (project / "data" / "chats" / ".gitignore").write_text("huge.*\n")
    (project / "data" / "raw" / "train.jsonl").write_text("{}\n")
    (project / "recipes" / "outputs" / "model" / "config.json").write_text("{}")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "config.json").write_text("{}")
    (project / "linked").symlink_to(elsewhere)
    (project / "inside").symlink_to(project / "data" / "raw")
    phi3 = recipes.load("recipes/phi3_dpo_fsdp.yaml")

    def judged(**settings):
        return node_paths.check(resolve(phi3, trl_overrides=settings))

    refused = {
        "dataset_name=data/chats": "data/chats/huge.jsonl is left out of the workdir's upload (SkyPilot's rsync, by "
        "the .gitignore of each folder and .git/info/exclude)",
        "model_name_or_path=./scratch/model": "scratch/model is left out of the workdir's upload (SkyPilot's rsync",
        "model_name_or_path=./linked": f"linked is left out of the workdir's upload (a link to {elsewhere}, outside "
        "it: SkyPilot's rsync copies the link, not what it names)",
    }
    for given, said in refused.items():
        key, value = given.split("=", 1)
        with pytest.raises(OrchError, match=re.escape(said)):
            judged(**{key: value})
    assert judged(dataset_name="data/raw", model_name_or_path="./recipes/outputs/model") == []
    assert judged(dataset_name="./inside") == []  # a link within the workdir: its target is uploaded too
    assert node_paths.uploaded(project, Path("data/raw")) == ()
    (project / "data" / "v[1]").mkdir()  # a name rsync would read as a pattern: escaped
    (project / "data" / "v[1]" / "train.jsonl").write_text("{}\n")
    assert node_paths.uploaded(project, Path("data/v[1]")) == ()
    from sky.utils import command_runner  # the filter is SkyPilot's: an upgrade that changes it fails here

    assert node_paths.RSYNC_FILTER == {
        ".skyignore": shlex.split(command_runner.RSYNC_FILTER_SKYIGNORE)[0],
        ".gitignore": shlex.split(command_runner.RSYNC_FILTER_GITIGNORE)[0],
    }
    assert node_paths.GIT_EXCLUDE == command_runner.GIT_EXCLUDE


def test_resume_at_fewer_nodes_checks_the_disk_there_with_the_recorded_disk_size(in_project, fake, capsys,
                                                                                   monkeypatch):  # fmt: skip
    """A sharded checkpoint's share grows as the nodes get fewer: the 70B at 4 nodes holds ~353 GB on node 0 (its 141 GB
    download and a 212 GB share), at 3 nodes ~423 GB. Launched with --disk-size 400, its resume at 3 nodes is
    refused before anything is sent (the recipe's own 512 would have let it through)."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["run", "llama3_70b_sft_fsdp", "--secret", "HF_TOKEN", "--disk-size", "400", "--env",
                     "GLOBAL_BATCH_SIZE=96", "-y", "--detach"]) == 0, capsys.readouterr().err  # fmt: skip
    (record,) = run_files(in_project)
    assert cli.main(["cancel", record.stem]) == 0
    before, calls = record.read_text(), len(fake.calls)
    capsys.readouterr()
    assert cli.main(["run", "--resume", record.stem, "--nodes", "3", "-y", "--detach"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("orch: error: node 0's disk is too small for this run: ~423.3 GB at once") and \
        "against resources.disk_size 400 GB; give --disk-size 512 " in line, line  # fmt: skip
    assert record.read_text() == before and len(fake.calls) == calls
    assert cli.main(["run", "--resume", record.stem, "--disk-size", "600", "-y", "--detach"]) == 2  # same cluster
    assert "a relaunch at the recorded shape keeps its cluster's disks" in capsys.readouterr().err
    assert cli.main(["run", "--resume", record.stem, "--nodes", "3", "--disk-size", "600", "-y", "--detach"]) == 0
    (name, sent, _) = fake.calls[-1]
    assert name == "launch" and sent.num_nodes == 3 and [r.disk_size for r in sent.resources] == [600]
    assert "disk_size: 600" in record.read_text()
