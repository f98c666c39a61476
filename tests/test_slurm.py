"""Slurm without SkyPilot, on a real Slurm cluster: Debian's slurm-wlm and munge, slurmctld and one slurmd
per emulated node, each in its own network namespace with its own address, host name and spool directory
(tests/slurm_cluster.py). The example sbatch script trains a 2-node smoke recipe as one world of 2 ranks across the
two slurmd nodes, and `scancel` stops every rank. As root with the packages installable, nothing here skips."""

import shutil
import sys
import time

import pytest
from conftest import ROOT
from slurm_cluster import SlurmCluster, missing
from test_faults import processes_with

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("slurm")]  # one worker: the Slurm clusters share munged


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()  # waits for the packages conftest started installing
    if why:
        pytest.skip(f"a local Slurm cluster {why}")
    with SlurmCluster(nodes=2, root=tmp_path_factory.mktemp("slurm")) as made:
        yield made


def submit(cluster, project, *words, env=()) -> str:
    shutil.copytree(ROOT / "recipes", project / "recipes", dirs_exist_ok=True)
    shutil.copytree(ROOT / "examples", project / "examples", dirs_exist_ok=True)
    exports = ",".join(["ALL", "ORCH_SKIP_SETUP=1", f"ORCH_VENV={sys.prefix}", "ORCH_DEVICE=cpu",
                        "ORCH_GPUS_PER_NODE=1", f"CHECKPOINT_ROOT={project / 'ckpt'}", "ORCH_RENDEZVOUS_TIMEOUT=60",
                        "GLOO_SOCKET_IFNAME=onode", *env])  # fmt: skip
    done = cluster.run("sbatch", "--parsable", "--nodes=2", f"--chdir={project}", f"--export={exports}",
                       "examples/slurm/orch.sbatch", "recipes/qwen25_sft_ddp.yaml", "--smoke", *words)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def wait_for(cluster, job: str, until, timeout: float) -> str:
    log = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = cluster.project / f"orch-{job}.log"  # the script's #SBATCH --output, in --chdir
        log = path.read_text() if path.exists() else ""
        if until(log):
            return log
        time.sleep(1)
    raise AssertionError(f"job {job}: timed out; log so far:\n{log[-3000:]}\n{cluster.logs()}")


def gone(cluster, job: str) -> bool:
    return cluster.run("squeue", "-h", "-j", job).stdout.strip() == ""


def test_sbatch_trains_one_world_across_two_slurm_nodes_and_scancel_stops_every_rank(cluster, tmp_path):
    """One job (its steps would run for hours): both slurmd nodes' launchers, one world of 2 ranks read back from the
    training processes, a checkpoint both nodes wrote their manifests for; then `scancel` and nothing is left."""
    cluster.project = tmp_path
    job = submit(cluster, tmp_path, "max_steps=100000", "save_steps=2", "save_total_limit=100000")  # kept: no rotation
    output = tmp_path / "ckpt" / f"slurm-{job}"
    saved = output / "checkpoint-2" / "orch_manifest.node1.json"
    log = wait_for(cluster, job, lambda text: ("[orch] step 3/" in text and saved.exists()) or gone(cluster, job),
                   timeout=600)  # fmt: skip
    assert "[orch] step 3/" in log and "Traceback" not in log, log[-3000:]
    assert "[orch] node 0/2: 1 process(es) here, 2 in all, head orch-node1, running DDP over gloo (Slurm)" in log, log
    assert "[orch] node 1/2: 1 process(es) here, 2 in all, head orch-node1, running DDP over gloo (Slurm)" in log
    assert "--num_processes 2 --num_machines 2 --machine_rank 1 --main_process_ip orch-node1" in log
    for rank in (0, 1):  # printed by each training process from its own process group
        assert f"[orch] rank {rank}/2: distributed_type=MULTI_CPU device=cpu:0 backend=gloo" in log
    assert (output / "checkpoint-2" / "orch_manifest.node0.json").is_file()
    assert len(processes_with(f"SLURM_JOB_ID={job}")) >= 4  # per node: orch node, accelerate, its rank...
    stopped = cluster.run("scancel", job)
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 60
    while (processes_with(f"SLURM_JOB_ID={job}") or not gone(cluster, job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(f"SLURM_JOB_ID={job}") == [] and gone(cluster, job)
