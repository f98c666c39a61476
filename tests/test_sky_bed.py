"""Real SkyPilot on a local Slurm cluster (tests/sky_bed.py): SkyPilot's own API server, Slurm provisioner, runtime
setup, log streaming and teardown, offline, as root. A recipe launched with plain `sky launch` (no orch on the laptop)
runs its real `setup:` (scripts/node-setup.sh installs uv.lock into an environment that holds only torch) and `run:`
on two Slurm nodes: one world of two ranks, FSDP2 over gloo."""

import importlib
import inspect
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT

# one pytest-xdist worker with test_slurm.py: the Slurm clusters share munged
pytestmark = [pytest.mark.root, pytest.mark.skypilot, pytest.mark.xdist_group("slurm")]


@pytest.mark.unit
@pytest.mark.parametrize("shim", ["curl", "uv", "uv cache", "node-local /tmp"])
def test_each_shim_answers_a_line_skypilot_still_has(shim):
    """A SkyPilot upgrade that moves one of these lines fails here, naming the shim to revisit."""
    from sky_bed import SHIMS

    module, text = SHIMS[shim]
    source = inspect.getsource(importlib.import_module(module))
    assert text in source, f"shim {shim!r}: {module} no longer has {text!r}; check tests/sky_bed.py against it"


@pytest.fixture(scope="module")
def bed():
    from sky_bed import BED_HOMES, SkyBed, missing

    why = missing()
    if why:
        pytest.skip(f"the SkyPilot bed {why}")
    root = Path(tempfile.mkdtemp(prefix=Path(BED_HOMES).name + "-", dir=Path(BED_HOMES).parent))
    with SkyBed(root) as made:
        made.orch_image()
        yield made
    # teardown left nothing: no process of the bed's user, no namespace, no user
    import pwd

    from sky_bed import USER

    with pytest.raises(KeyError):
        pwd.getpwnam(USER)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in namespaces.split() if n in made.cluster.network.namespaces]
    assert not made._user_pids()


def launch(bed, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`sky launch` from the repository root (the recipe's workdir), as a user of the bed types it."""
    sky = Path(sys.executable).parent / "sky"
    return subprocess.run([str(sky), "launch", *argv], cwd=ROOT, env=bed.env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_plain_sky_launch_runs_the_recipe_on_two_slurm_nodes(bed, tmp_path):
    task = tmp_path / "phi3_slurm.yaml"
    made = subprocess.run([sys.executable, "scripts/on-slurm.py", "recipes/phi3_dpo_fsdp.yaml"], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    task.write_text(made.stdout)
    result = launch(bed, str(task), "--infra", f"slurm/{bed.name}", "--gpus", "none", "--num-nodes", "2", "-c", "phi3",
                    "-y", "--env", "ORCH_DEVICE=cpu", "--env", "ORCH_SMOKE=on", "--env",
                    f"ORCH_VENV={bed.orch_image()}")  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "Job finished (status: SUCCEEDED)" in out
    # the setup: uv.lock installed into an environment that held only torch, offline; the head node rehearsed
    assert "[orch] setup: torch 2.13.0 is there: kept" in out and "installing uv.lock's orch[train]" in out
    assert "[orch] rehearsed 2 role(s) of 2 rank(s) with transformers" in out
    # one world of 2 ranks over the two Slurm nodes, FSDP2 over gloo, as each node says and each rank reports
    for rank in (0, 1):
        assert f"[orch] node {rank}/2: 1 process(es) here, 2 in all" in out and "running FSDP2 over gloo" in out
    assert "[orch] step 8/8 loss=" in out
    final = next(line for line in out.splitlines() if "[orch] final model: " in line)
    output_dir = Path(final.split("[orch] final model: ")[1].split(" (")[0])
    assert output_dir.parent == bed.home / "orch-checkpoints"  # CHECKPOINT_ROOT=~/...: the account's shared home
    reports = [json.loads((output_dir / "orch" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["distributed_type"]) for r in reports] == [(0, 2, "FSDP"), (1, 2, "FSDP")]
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "checkpoint-8").is_dir()
    # SkyPilot's own commands on the cluster it made
    queue = bed.sky("queue", "phi3")
    assert queue.returncode == 0 and "SUCCEEDED" in queue.stdout, queue.stdout + queue.stderr
    logs = bed.sky("logs", "phi3", "1", "--no-follow")
    assert logs.returncode == 0 and "[orch] step 8/8" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
    down = bed.sky("down", "phi3", "-y")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "phi3" not in bed.sky("status").stdout
    assert bed.cluster.run("squeue", "-h").stdout.strip() == ""  # the cluster's Slurm job is gone with it


def test_orch_run_through_skypilots_sdk_and_its_commands_act_on_real_state(bed, tmp_path):
    """`orch run --infra slurm/... --gpus none --smoke` through SkyPilot's SDK and API server: it launches, follows
    the logs, records the run; `orch status`, `orch logs`, `orch down` answer from SkyPilot."""
    import shutil

    project = tmp_path / "repo"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".venv", ".git", "outputs", "sky_jobs", "__pycache__",
                                                                  ".mypy_cache", "*.egg-info", "build"))  # fmt: skip
    env = {**bed.env, "ORCH_REHEARSAL": "off"}  # the head node rehearses in its setup, as ever

    def orch(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *argv], cwd=project, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    run = orch("run", "phi3_dpo_fsdp", "--infra", f"slurm/{bed.name}", "--nodes", "2", "--gpus", "none", "--smoke",
               "--cluster", "orch1", "-y", "--env", f"ORCH_VENV={bed.orch_image()}")  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "[orch] step 8/8 loss=" in out and "running FSDP2 over gloo" in out
    assert "[orch] rehearsed 2 role(s) of 2 rank(s)" in out  # the head's setup
    (record,) = sorted((project / "sky_jobs").glob("*.yaml"))
    text = record.read_text()
    assert "# platform: sky" in text and "# cluster: orch1" in text and "# job_id: 1" in text
    assert "CHECKPOINT_ROOT: ~/orch-checkpoints" in text and "file_mounts" not in text
    status = orch("status", record.stem)
    assert status.returncode == 0 and "cluster UP" in status.stdout, status.stdout + status.stderr
    logs = orch("logs", record.stem)
    assert logs.returncode == 0 and "[orch] step 8/8" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
    down = orch("down", record.stem)
    assert down.returncode == 0 and "tore down cluster orch1" in down.stdout, down.stdout + down.stderr
    assert "# state: down" in record.read_text()
    assert bed.cluster.run("squeue", "-h").stdout.strip() == ""
