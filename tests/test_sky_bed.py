"""Real SkyPilot on a local Slurm cluster (tests/sky_bed.py): SkyPilot's own API server, Slurm provisioner, runtime
setup, log streaming and teardown, offline, as root. A recipe launched with plain `sky launch` (no orch on the laptop)
runs its real `setup:` (scripts/node-setup.sh installs uv.lock into an environment that holds only torch) and `run:`
on two Slurm nodes: one world of two ranks, FSDP2 over gloo."""

import contextlib
import importlib
import inspect
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT

# one pytest-xdist worker with test_slurm.py: the Slurm clusters share munged
pytestmark = [pytest.mark.root, pytest.mark.skypilot, pytest.mark.xdist_group("slurm")]


@pytest.mark.unit
@pytest.mark.parametrize("shim", ["curl", "uv", "uv cache", "node-local /tmp", "network check", "network check loop"])
def test_each_shim_answers_a_line_skypilot_still_has(shim):
    """A SkyPilot upgrade that moves one of these lines fails here, naming the shim to revisit."""
    from sky_bed import SHIMS

    module, text = SHIMS[shim]
    source = inspect.getsource(importlib.import_module(module))
    assert text in source, f"shim {shim!r}: {module} no longer has {text!r}; check tests/sky_bed.py against it"


STOPPED = """
import os, signal, sys, time
sys.path.insert(0, "tests")
from sky_bed import exit_on_signals
exit_on_signals()
try:
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(30)
finally:
    print("taken down", flush=True)
"""


@pytest.mark.unit
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_stopped_bed_or_bench_still_runs_its_teardown(sig):
    """`make sky-bed` and the bench's bed (bench/first_step.py) stopped by a `kill` or a closed terminal leave as Ctrl-C
    does, through their `with` and `finally` blocks, which take the bed's processes, namespaces and directory down."""
    import signal

    stopped = subprocess.run([sys.executable, "-c", STOPPED, sig], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert stopped.stdout == "taken down\n", stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + getattr(signal, sig), stopped.stderr


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    from sky_bed import BED_HOMES, SkyBed, missing

    why = missing()
    if why:
        pytest.skip(f"the SkyPilot bed {why}")
    root = Path(tempfile.mkdtemp(prefix=Path(BED_HOMES).name + "-", dir=Path(BED_HOMES).parent))
    try:
        # SkyPilot's jobs controller in its API server, for --managed; the tests' directories (their projects, a
        # task's workdir) visible in its /tmp
        with SkyBed(root, managed=True, visible=(tmp_path_factory.getbasetemp(),)) as made:
            made.orch_image()
            yield made
            # the API server and its workers keep their semaphores in a /dev/shm of their own and SkyPilot's literal
            # /tmp files in a /tmp of their own (the bed's), gone with them
            shm, seen = os.stat("/dev/shm").st_dev, set()
            for pid in made._client_pids():
                with contextlib.suppress(OSError):  # a process that ended meanwhile
                    seen.add((os.stat(f"/proc/{pid}/root/dev/shm").st_dev, os.stat(f"/proc/{pid}/root/tmp").st_ino))
            assert seen and shm not in {dev for dev, _ in seen}, "SkyPilot's API server shares this machine's /dev/shm"
            assert {ino for _, ino in seen} == {os.stat(made.server_tmp).st_ino}, "its /tmp is not the bed's"
            assert (made.server_tmp / "jobs_ha_recovery.log").is_file()  # written by its jobs controller at its start
    finally:
        shutil.rmtree(root, ignore_errors=True)  # its homes, image and checkpoints (GBs): the uv cache is shared
    # teardown left nothing: no process of the bed's user, no namespace, no user
    import pwd

    from sky_bed import USER

    with pytest.raises(KeyError):
        pwd.getpwnam(USER)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in namespaces.split() if n in made.cluster.network.namespaces]
    assert not made._user_pids()
    assert not made._client_pids()  # SkyPilot's API server and its workers, root's processes with the client's HOME
    # nor a job step's slurmstepd (root's, reparented to init when its slurmd stops): the suite runs Slurm tests one
    # at a time (xdist_group "slurm"), so any here is this bed's
    steps = subprocess.run(["pgrep", "-a", "-x", "slurmstepd"], capture_output=True, text=True).stdout.strip()
    assert not steps, steps
    # nor SkyPilot's ssh control masters (ControlPersist, reparented to init) and their directory in this machine's /tmp
    assert not made._ssh_master_pids()
    assert not made.ssh_controls.exists()


def launch(bed, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`sky launch` from the repository root (the recipe's workdir), as a user of the bed types it."""
    sky = Path(sys.executable).parent / "sky"
    return subprocess.run([str(sky), "launch", *argv], cwd=ROOT, env=bed.env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def orch_in_a_copy(bed, tmp_path):
    """orch as a user of the bed runs it, from a copy of the repository (the runs' records go to the copy's sky_jobs/),
    and that copy. The client does not rehearse: the head node does in its setup, at every (re)launch."""
    from sky_bed import REPO_COPY_IGNORE

    project = tmp_path / "repo"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(*REPO_COPY_IGNORE))
    env = {**bed.env, "ORCH_REHEARSAL": "off"}

    def orch(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *argv], cwd=project, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    return orch, project


PLAN_MEMORY = """
import sys
from orchestrator.launch.backends import sky
plan = sky.optimize({"resources": {"infra": sys.argv[1], "cpus": 1}, "num_nodes": 2, "run": "true"})
print("MEMORY", plan.memory_gib, "FROM", plan.memory_from)
"""


def test_the_planned_nodes_memory_comes_from_slurm_itself(bed):
    """The bed tracks no memory (SelectTypeParameters=CR_CPU), so SkyPilot omits --mem and orch reads the nodes'
    RealMemory (4000 MB in tests/slurm_cluster.py) through SkyPilot's own Slurm inventory, for the host-memory check."""
    plan = subprocess.run([sys.executable, "-c", PLAN_MEMORY, f"slurm/{bed.name}"], cwd=ROOT, env=bed.env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr[-3000:]
    gib, source = re.search(r"^MEMORY (\S+) FROM (.*)$", plan.stdout, re.M).groups()
    assert float(gib) == pytest.approx(4000 / 1024, rel=0.01), plan.stdout
    assert source == f"the smallest RealMemory of Slurm cluster {bed.name} (no --mem: memory not tracked)"
    # SkyPilot's ssh to the login node, from the client, kept its control socket under the bed's own user hash (which
    # the bed removes), not this machine's user's
    assert any(bed.ssh_controls.iterdir()), f"no ssh control socket under {bed.ssh_controls}"


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
    # the caches on the account's home, not the cluster's $HOME (~/.sky_clusters/<cluster>, gone with the cluster)
    assert out.count(f"[orch] prefetch: into HF_HOME={bed.home}/.cache/huggingface (the account's home") == 2
    assert any((bed.home / ".cache" / "orch" / "rehearsals").glob("*.json"))
    assert any((bed.home / ".cache" / "orch" / "smoke").glob("phi3-dpo-*/model"))
    # one world of 2 ranks over the two Slurm nodes, FSDP2 over gloo, as each node says and each rank reports
    for rank in (0, 1):
        assert f"[orch] node {rank}/2: 1 process(es) here, 2 in all" in out and "running FSDP2 over gloo" in out
    assert "[orch] step 8/8 loss=" in out
    # the head node's summary, read back from both nodes' rank reports on the account's shared home (core/summary.py)
    assert "[orch] ran: FSDP2 over gloo, world size 2 (ranks reporting: 0, 1)" in out, out[-3000:]
    assert "[orch] precision: fp32 compute, fp32 weights updated by the optimizer" in out
    final = next(line for line in out.splitlines() if "[orch] final model: " in line)
    output_dir = Path(final.split("[orch] final model: ")[1].split(" (")[0])
    assert output_dir.parent == bed.home / "orch-checkpoints"  # CHECKPOINT_ROOT=~/...: the account's shared home
    reports = [json.loads((output_dir / "orch" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["distributed_type"]) for r in reports] == [(0, 2, "FSDP"), (1, 2, "FSDP")]
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "checkpoint-8").is_dir()
    # each node's launch took its temporary files with it: torch's elastic agent left a torchelastic_* per launch in
    # the node's own /tmp, where SkyPilot keeps its runtime
    tmps = sorted((bed.root / "tmp").glob("node*"))
    assert len(tmps) == 2 and all(any(t.iterdir()) for t in tmps), tmps
    left = [p.name for t in tmps for p in t.iterdir() if p.name.startswith(("torchelastic_", "orch-launch-"))]
    assert not left, left
    # SkyPilot's own commands on the cluster it made, asked at once (each is seconds of SkyPilot's own waiting); and
    # without ORCH_VENV, a setup on these nodes takes the account's environment for this lock: SkyPilot's $HOME on a
    # Slurm node is the cluster's own, under the account's home (scripts/node-setup.sh --print-venv, on the node)
    with ThreadPoolExecutor(3) as pool:
        asked = [pool.submit(bed.sky, *argv) for argv in (
            ("queue", "phi3"), ("logs", "phi3", "1", "--no-follow"),
            ("exec", "phi3", "bash scripts/node-setup.sh --print-venv; echo HOME=$HOME"))]  # fmt: skip
        queue, logs, where = (ask.result() for ask in asked)
    assert queue.returncode == 0 and "SUCCEEDED" in queue.stdout, queue.stdout + queue.stderr
    assert logs.returncode == 0 and "[orch] step 8/8" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
    assert where.returncode == 0, where.stdout[-2000:] + where.stderr[-2000:]
    home = re.escape(str(bed.home))
    assert re.search(rf"\s{home}/\.cache/orch/venvs/[0-9a-f]{{16}}-[0-9a-f]{{8}}$", where.stdout, re.M), where.stdout
    assert re.search(rf"\sHOME={home}/\.sky_clusters/\S+$", where.stdout, re.M), where.stdout[-2000:]
    down = bed.sky("down", "phi3", "-y")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "phi3" not in bed.sky("status", "--no-show-managed-jobs", "--no-show-services", "--no-show-pools").stdout
    assert allocation_gone(bed) == ""  # the cluster's Slurm job is gone with it


def allocation_gone(bed, within: float = 60.0) -> str:
    """'' once a torn-down cluster's Slurm allocation has left the queue; right after the teardown it may still be
    COMPLETING (Slurm ends its processes: a fresh clone saw `CG` there), never running. Else what squeue says."""
    said = bed.cluster.run("squeue", "-h", "-o", "%i %T %j").stdout.strip()
    if any(line.split()[1] != "COMPLETING" for line in said.splitlines()):
        return said
    deadline = time.monotonic() + within
    while said and time.monotonic() < deadline:
        time.sleep(1)
        said = bed.cluster.run("squeue", "-h", "-o", "%i %T %j").stdout.strip()
    return said


def test_orch_run_through_skypilots_sdk_and_its_commands_act_on_real_state(bed, tmp_path):
    """`orch run --infra slurm/... --gpus none --smoke` through SkyPilot's SDK and API server: it launches and
    records the run; `orch cancel` mid-training ends every rank on both nodes and SkyPilot's job; `orch run --resume`
    relaunches it on the same cluster, whose setup finds nothing to do, from its last checkpoint to the end;
    `orch status`, `orch logs`, `orch down` answer from SkyPilot."""
    orch, project = orch_in_a_copy(bed, tmp_path)

    def training() -> list[str]:  # the run's processes on either node (the nodes share this machine's PIDs)
        found = subprocess.run(["pgrep", "-a", "-u", "orchsky", "-f", "orchestrator.train|accelerate|orch node"],
                               capture_output=True, text=True).stdout  # fmt: skip
        return found.strip().splitlines()

    # ~1 s a step here; measured: `orch cancel` returns after 7-8 s and the ranks are gone 13 s after it started
    # (at step 18-22, checkpoint-20 the last or checkpoint-10): 45 steps leave 20+ to spare (the cancel slows with the
    # steps under load) and a resumed leg of ~25 (60 steps gave ~40: each step and save is CPU the suite waits for)
    steps = 45
    # followed, as a user's terminal follows it (no --detach): its stream ends when the job is cancelled below
    followed = tmp_path / "run.out"
    with open(followed, "w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", "phi3_dpo_fsdp", "--infra",
                                f"slurm/{bed.name}", "--nodes", "2", "--gpus", "none", "--smoke", "--cluster", "orch1",
                                "-y", "--env", f"ORCH_VENV={bed.orch_image()}", f"max_steps={steps}", "save_steps=10"],
                               cwd=project, env={**bed.env, "ORCH_REHEARSAL": "off"}, stdout=sink,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    def recorded() -> str:
        found = sorted((project / "sky_jobs").glob("*.yaml"))
        return found[0].read_text() if found else ""

    try:
        deadline = time.monotonic() + 600
        while "# job_id: 1" not in (text := recorded()):
            assert run.poll() is None and time.monotonic() < deadline, followed.read_text()[-6000:]
            time.sleep(0.5)
        (record,) = sorted((project / "sky_jobs").glob("*.yaml"))
        name = record.stem
        assert "# platform: sky" in text and "# cluster: orch1" in text and "# job_id: 1" in text
        assert "CHECKPOINT_ROOT: ~/orch-checkpoints" in text and "file_mounts" not in text
        assert f"ORCH_RUN_ID: {name}" in text
        # checkpoints on the account's shared home, keyed by the run's name
        checkpoints = bed.home / "orch-checkpoints" / name
        while not any(checkpoints.glob("checkpoint-10/orch_manifest.node1.json")):
            over = (checkpoints / "model.safetensors").exists() or time.monotonic() > deadline or run.poll() is not None
            assert not over, followed.read_text()[-6000:]
            time.sleep(0.5)
        assert training(), "no training process while its checkpoints are being written"
        cancel = orch("cancel", name)
        assert cancel.returncode == 0 and f"[orch] cancelled {name}" in cancel.stdout, cancel.stdout + cancel.stderr
        cancelled = time.monotonic()
        while training():
            assert time.monotonic() - cancelled < 60, f"ranks outlived `orch cancel` by 60 s: {training()}"
            time.sleep(0.5)
        # the followed stream ended with the job: orch's last line says how (SkyPilot's SDK answered 103, CANCELLED)
        assert run.wait(timeout=60) == 1, followed.read_text()[-6000:]
    finally:
        if run.poll() is None:
            run.kill()
    out = followed.read_text()
    assert "its Slurm allocation ends after 10 idle minutes" in out
    assert out.rstrip().splitlines()[-1] == f"[orch] run {name}: SkyPilot's job 1 on cluster orch1 was cancelled", (
        out[-3000:])  # fmt: skip
    assert "# state: cancelled" in record.read_text()
    done = max(int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*"))
    assert done < steps, "the run finished before it was cancelled: nothing left to resume"

    again = orch("run", "--resume", name, "-y")
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-6000:]
    assert f"[orch] run {name}: relaunch 1, resuming from its last checkpoint (~/orch-checkpoints/{name})" in out
    assert "already holds uv.lock's orch[train] (installed by an earlier setup): nothing to install" in out
    start = int(re.search(r"resuming from \S+/checkpoint-(\d+)", out).group(1))
    assert 10 <= start <= done, out[-3000:]
    assert f"[orch] step {steps}/{steps} loss=" in out and "running FSDP2 over gloo" in out
    assert f"[orch] step {start}/{steps}" not in out  # the steps before the checkpoint were not trained again
    # time to first step from the moment `orch run` submitted, SkyPilot's part named (core/timeline.py)
    assert re.search(r"\[orch\] time to first step: [\d.]+ s = SkyPilot's provisioning, runtime and job start [\d.]+ "
                     r"\+ setup [\d.]+ \(install [\d.]+, rehearsal", out), out[-3000:]
    text = record.read_text()
    assert "# job_id: 2" in text and "# relaunches: 1" in text
    # orch's answers from SkyPilot, and the fake SDK the other tests use answering in the real one's shapes (the fields
    # orch reads, and their kinds), asked at once (seconds of SkyPilot's waiting each); the same queue answer says
    # SkyPilot's job 1 was CANCELLED and the relaunch's job 2 SUCCEEDED
    import sky
    from fake_sky import FakeSky, shapes

    probe = ("import json, sys, sky; sys.path.insert(0, 'tests'); import fake_sky; states = {}; "
             "print(json.dumps([fake_sky.shapes(sky, 'orch1', states), states]))")
    with ThreadPoolExecutor(3) as pool:
        asked = [pool.submit(orch, "status", name), pool.submit(orch, "logs", name),
                 pool.submit(subprocess.run, [sys.executable, "-c", probe], cwd=ROOT, env=bed.env, capture_output=True,
                             text=True, timeout=120)]  # fmt: skip
        status, logs, real = (ask.result() for ask in asked)
    assert status.returncode == 0 and "cluster UP" in status.stdout, status.stdout + status.stderr
    assert logs.returncode == 0 and f"[orch] step {steps}/{steps}" in logs.stdout, logs.stdout[-2000:] + logs.stderr
    assert real.returncode == 0, real.stderr[-2000:]
    real_shapes, states = json.loads(real.stdout.strip().splitlines()[-1])
    assert states == {"1": "CANCELLED", "2": "SUCCEEDED"}, states
    assert real_shapes == shapes(FakeSky(sky), "orch1")
    down = orch("down", name)
    assert down.returncode == 0 and "tore down cluster orch1" in down.stdout, down.stdout + down.stderr
    assert "# state: down" in record.read_text()
    assert allocation_gone(bed) == ""


def test_a_managed_job_recovers_from_a_node_failure_and_resumes_from_its_checkpoint(bed, tmp_path):
    """`orch run --managed` through SkyPilot's jobs controller (consolidation mode, in the bed's API server): a node
    fails mid-training (every process on it killed, the node marked DOWN); SkyPilot's controller sees the cluster fail,
    provisions it again once the node is back, and the job resumes from the last complete checkpoint, its earlier
    attempt's spend counted, to SUCCEEDED with one recovery."""
    orch, project = orch_in_a_copy(bed, tmp_path)

    def queue() -> str:  # the managed job's row, for a failure's message: ID TASK NAME ... #RECOVERIES STATUS ...
        out = bed.sky("jobs", "queue").stdout
        return next((line for line in out.splitlines() if re.match(r"^\s*1\s", line)), "")

    # The job's state as SkyPilot's jobs controller stores it (its API server's database, read-only), looked at every
    # half second: `sky jobs queue` is ~6 s of CPU for the CLI, the API server and the process it starts (measured on
    # the bed), and asked every few seconds it took about one of this machine's two cores from the training it watched
    # (CI, 2026-11-24: the crash came after step 40). orch's own view of the job (`orch status`, SkyPilot's queue
    # through its SDK) is asserted at the end.
    database = bed.client / ".sky" / "spot_jobs.db"  # sky/jobs/state.py, under the API server's home

    def state() -> str:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
                row = db.execute("SELECT status FROM spot WHERE spot_job_id = 1 ORDER BY task_id DESC").fetchone()
        except sqlite3.Error:  # not made yet, or written at this instant
            return ""
        return str(row[0]) if row else ""

    steps = 30  # the node fails within a second of the first complete checkpoint (10): 20 steps to spare
    run = orch("run", "phi3_dpo_fsdp", "--infra", f"slurm/{bed.name}", "--nodes", "2", "--gpus", "none", "--smoke",
               "--managed", "-y", "--detach", "--env", f"ORCH_VENV={bed.orch_image()}", f"max_steps={steps}",
               "save_steps=10")  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "managed job" in out and "[orch] submitted: backend=sky-managed, job_id=1" in out, out[-3000:]
    (record,) = sorted((project / "sky_jobs").glob("*.yaml"))
    name = record.stem
    checkpoints = bed.home / "orch-checkpoints" / name

    log = bed.client / "sky_logs" / "jobs_controller" / "1.log"  # SkyPilot's jobs controller's own log of this job

    def why() -> str:  # and Slurm's side: its steps and daemons' logs (a recovery's srun once waited minutes)
        steps = bed.cluster.run("squeue", "-s", "-h").stdout
        return (f"state {state()!r}; {queue()}\n{log.read_text()[-4000:] if log.is_file() else 'no controller log'}"
                f"\nSlurm's steps:\n{steps}{bed.cluster.logs()}")

    def ended() -> bool:  # SUCCEEDED, CANCELLED or one of the FAILED states (CANCELLING is not one)
        return bool(re.fullmatch(r"SUCCEEDED|FAILED\w*|CANCELLED", state()))

    deadline = time.monotonic() + 360  # ~90 s here
    while not any(checkpoints.glob("checkpoint-*/orch_manifest.node1.json")):
        assert time.monotonic() < deadline and not (checkpoints / "model.safetensors").exists(), why()
        assert not ended(), why()
        time.sleep(0.5)
    # the node that holds rank 1 fails; the other node's rank loses its peer
    bed.cluster.crash(2)
    failed = time.monotonic()
    saved = max(int(p.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*"))
    assert saved < steps, f"the node failed after checkpoint-{saved}: nothing left to recover"
    bed.cluster.restart(2)
    # the recovered attempt's end in SkyPilot's state (the controller looks every 15 s), then its cluster taken down:
    # the Slurm allocation goes with it
    while not ended():
        assert time.monotonic() - failed < 480, why()  # ~100 s here
        time.sleep(0.5)
    assert state() == "SUCCEEDED", why()
    while bed.cluster.run("squeue", "-h").stdout.strip():
        assert time.monotonic() - failed < 540, bed.cluster.run("squeue", "-h").stdout
        time.sleep(1)
    # orch's log (SkyPilot's copy, downloaded before the cluster went) and status of the run, asked at once
    with ThreadPoolExecutor(2) as asks:
        logs, status = asks.submit(orch, "logs", name), asks.submit(orch, "status", name)
        logs, status = logs.result(), status.result()
    text = logs.stdout
    assert logs.returncode == 0 and f"[orch] step {steps}/{steps} loss=" in text, text[-3000:] + logs.stderr
    start = int(re.search(r"resuming from \S+/checkpoint-(\d+)", text).group(1))  # the recovered attempt's log
    assert 10 <= start < steps, text[-3000:]
    assert f"[orch] step {start + 1}/{steps}" in text and f"[orch] step {start}/{steps}" not in text
    assert "[orch] spend: 1 earlier attempt(s) of this run" in text  # the first attempt's time, on the shared home
    # SkyPilot's count of recoveries, and no deprecation warning of its v1 queue
    assert "deprecated" not in status.stdout + status.stderr, status.stdout + status.stderr
    finished = re.search(rf"{name}\s+sky-managed\s+SUCCEEDED, 1 recovery\s+{steps}/{steps}", status.stdout)
    assert status.returncode == 0 and finished, status.stdout + status.stderr
    assert (checkpoints / "model.safetensors").is_file()
