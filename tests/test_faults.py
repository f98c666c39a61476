"""Survive faults: resume from complete checkpoints, stop the whole gang fast, name a node that never joins,
reject bad input with one line and nothing written. Secrets kept out of files, logs and argv: the Hub push
smoke run in test_trainers_smoke.py, which holds a real one."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port, loss_log, orch

from orchestrator.train.checkpoints import (
    MANIFEST,
    choose_resume,
    quarantine,
    verify,
    write_manifest,
)

pytestmark = pytest.mark.unit


def processes_with(*env_entries: str) -> list[int]:
    """PIDs whose environment holds every one of env_entries (e.g. SKYPILOT_TASK_ID=<run>), in order."""
    wanted = [entry.encode() for entry in env_entries]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(entry in environ for entry in wanted):
            found.append(int(proc.name))
    return sorted(found)


def start_orch(project: Path, argv: list[str], until: str = "") -> tuple[subprocess.Popen, str]:
    """`orch ARGV` in the background; returns it and its run id once it announced the run (and then printed a line
    holding `until`, when given)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = None
    proc.seen = []  # the lines read here
    for line in proc.stdout:
        proc.seen.append(line)
        match = re.match(r"^\[orch\] run (\S+):", line)
        run = run or (match.group(1) if match else None)
        if run and until in line:
            break
    assert run, "orch did not announce its run"
    return proc, run


def node_pids(run: str, rank: int) -> list[int]:
    return processes_with(f"SKYPILOT_TASK_ID={run}", f"SKYPILOT_NODE_RANK={rank}")


# ---------------------------------------------------------------- checkpoints


def _checkpoint(root: Path, step: int, nodes: int = 2, manifests=None) -> Path:
    ckpt = root / f"checkpoint-{step}"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(4096))
    (ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(os.urandom(1000))
    (ckpt / "trainer_state.json").write_text("{}")
    for node in range(nodes) if manifests is None else manifests:
        write_manifest(ckpt, node, nodes, step)
    return ckpt


def test_a_manifest_never_lists_another_nodes_manifest_in_progress(tmp_path):
    """Nodes write their manifests at the same time into a shared checkpoint: node 0's temp file, present while node
    1 lists the directory, must not become a file node 1's manifest requires (seen once in a 2-node run)."""
    ckpt = _checkpoint(tmp_path, 8, manifests=[])
    (ckpt / ".orch_manifest.node0.json.tmp").write_text("{}")  # node 0 is writing its manifest
    write_manifest(ckpt, 1, 2, 8)
    (ckpt / ".orch_manifest.node0.json.tmp").unlink()  # ... and renames it
    write_manifest(ckpt, 0, 2, 8)
    assert verify(ckpt, node=0) == "" and verify(ckpt, node=1) == ""


def test_only_checkpoints_whose_manifests_verify_are_picked(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 8)
    _checkpoint(tmp_path, 12, manifests=[0])  # node 1 never finished its save
    (tmp_path / "checkpoint-x").mkdir()
    assert choose_resume(tmp_path, None, lambda step: step)[0] == tmp_path / "checkpoint-8"
    assert verify(tmp_path / "checkpoint-12") == "node(s) 1 wrote no manifest"
    assert choose_resume(tmp_path / "missing", None, lambda step: step) == (None, [])
    # a marker alone (as a bucket upload may deliver it before the shards) is not a manifest
    ckpt = _checkpoint(tmp_path, 16, manifests=[])
    (ckpt / "orch_complete").write_text("{}")
    assert verify(ckpt) == "no manifest (the save did not finish)"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: (c / "model.safetensors").write_bytes(b"x" * 100), "model.safetensors has 100 bytes"),
        (lambda c: (c / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
        (lambda c: (c / "orch_manifest.node1.json").write_text("{trunc"), "unreadable manifest"),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_and_quarantined(tmp_path, damage, reason):
    _checkpoint(tmp_path, 4)
    damage(_checkpoint(tmp_path, 8))
    chosen, skipped = choose_resume(tmp_path, 0, lambda x: x)
    assert chosen == tmp_path / "checkpoint-4"
    assert [p.name for p, _ in skipped] == ["checkpoint-8"] and reason in skipped[0][1]
    listed = quarantine(tmp_path, skipped)
    assert json.loads(listed.read_text())["checkpoint"] == "checkpoint-8"
    assert (tmp_path / "checkpoint-8").is_dir()  # never renamed or deleted: on a bucket that copies terabytes


def test_same_size_corruption_is_caught_by_the_node_that_hashed_the_file(tmp_path):
    _checkpoint(tmp_path, 4)
    ckpt = _checkpoint(tmp_path, 8)
    (ckpt / "model.safetensors").write_bytes(os.urandom(4096))  # same size, other bytes
    hashed = {n: json.loads((ckpt / MANIFEST.format(n)).read_text())["sha256"] for n in (0, 1)}
    owner = next(n for n in (0, 1) if "model.safetensors" in hashed[n])
    assert verify(ckpt) == "" and verify(ckpt, node=1 - owner) == ""  # sizes match; the other node hashed others
    assert "does not match its SHA-256" in verify(ckpt, node=owner)

    # two ranks agree through a min over ranks (threads here, the all-reduce in a run): the owner's verdict counts
    assert _two_ranks(tmp_path) == [tmp_path / "checkpoint-4"] * 2


def _two_ranks(output_dir: Path) -> list:
    import threading

    barrier, values, chosen = threading.Barrier(2), [0, 0], [None, None]

    def min_over_ranks(rank: int, value: int) -> int:
        values[rank] = value
        barrier.wait()
        result = min(values)
        barrier.wait()
        return result

    def rank(node: int) -> None:
        chosen[node] = choose_resume(output_dir, node, lambda v: min_over_ranks(node, v))[0]

    threads = [threading.Thread(target=rank, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return chosen


def test_checkpoint_dir_is_keyed_by_task_id_under_checkpoint_root(node_env):
    from orchestrator.node import plan as node

    env = node_env(
        2,
        8,
        1,
        CHECKPOINT_ROOT="/checkpoints/",
        SKYPILOT_TASK_ID="sky-managed-7_1",
        TRL_OVERRIDES="output_dir=elsewhere",
    )
    argv = node.plan(env, {"distributed_type": "FSDP"}, {"per_device_train_batch_size": 4}).argv
    assert argv[argv.index("--output_dir") + 1] == "/checkpoints/sky-managed-7_1"
    assert "elsewhere" not in argv


@pytest.mark.e2e
@pytest.mark.xdist_group("phi3_fsdp2_run")
def test_killed_node_stops_the_gang_and_the_rerun_resumes_exactly(project, phi3_fsdp2_run):
    """Node 1 killed once checkpoint-4 is complete: the gang stops, the rerun resumes at step 4 and trains steps 5-8
    at the losses of the uninterrupted run (the demo's run, conftest.phi3_fsdp2_run: the same command)."""
    command = ["run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke"]
    expected = phi3_fsdp2_run.losses
    assert sorted(expected) == list(range(1, 9))

    proc, run = start_orch(project, command)
    output_dir = project / "outputs" / run
    deadline = time.monotonic() + 120
    while not any(output_dir.glob("checkpoint-*/orch_manifest.node1.json")):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint before the run ended"
        time.sleep(0.02)
    victims = node_pids(run, 1)
    assert victims, "found no process of node 1"
    killed_at = time.monotonic()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) != 0
    while processes_with(f"SKYPILOT_TASK_ID={run}"):
        assert time.monotonic() - killed_at < 30, "processes of the run outlived the gang stop by 30 s"
        time.sleep(0.2)
    assert "[orch] node 1 exited with code" in rest and "stopping the other nodes" in rest

    resumed = orch(*command, cwd=project)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "[orch] ran: FSDP2 over gloo" in resumed.stdout  # the resumed checkpoint is FSDP2's sharded one
    assert "(sharded: 2 distcp shard file(s) in pytorch_model_fsdp_0/)" in resumed.stdout
    start = int(re.search(r"resuming from \S+/checkpoint-(\d+)", resumed.stdout).group(1))
    assert start == 4  # killed in steps 5-8: checkpoint-8 never completed
    after = loss_log(output_dir)
    assert sorted(after) == list(range(start + 1, 9))
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], abs=1e-4), step
    assert json.loads((output_dir / "orch" / "rank0.json").read_text())["optimizer_steps"] == 8


@pytest.mark.e2e
def test_a_rank_that_exits_early_is_named_as_the_cause(project):
    """Rank 1 calls sys.exit(0) at step 3 (tests/fixtures/rank_fault/sitecustomize.py): rank 0 then fails in its next
    collective with a network error. The run names rank 1 and is not reported as a retryable network failure. Its
    Trackio curves (--track) up to the failure reach the dashboard, though no checkpoint was saved (the first is at
    step 4): each node copies its database when training ends, failed or not (before, none was there to show)."""
    from test_resume import trackio_runs

    fault = ROOT / "tests" / "fixtures" / "rank_fault"
    done = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--track", "--env",
                f"PYTHONPATH={fault}", "--env", "TEST_RANK_FAULT=exit", cwd=project, timeout=300)  # fmt: skip
    assert done.returncode != 0
    final = done.stdout.strip().splitlines()[-1]
    assert "rank 1 (node 1) exited with code 0 at step 3, before training ended" in final, done.stdout[-3000:]
    assert "retryable" not in final and "orch exits 75" not in done.stdout
    run = re.search(r"^\[orch\] output: \S+/(\S+)$", done.stdout, re.M).group(1)
    shown = orch("dashboard", run, "--no-open", cwd=project, env={"ORCH_CACHE_DIR": str(project / "cache")})
    assert shown.returncode == 0, shown.stderr
    rows = trackio_runs(project / "cache" / "dashboards" / run / "trackio", "qwen25_sft_ddp")[run]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2], rows  # step 3's logging gathers from rank 1


@pytest.mark.e2e
def test_a_rank_that_raises_records_itself_where_the_other_nodes_look(project):
    """Rank 1 raises a ValueError at step 3: it records itself in the run's early-exit directory (train/entry._raised),
    so a node whose ranks then see only the connection close names it at once and exits 1, not 75, which a managed job
    would recover on without limit (SkyPilot's recover_on_exit_codes) and hit the same bug again."""
    fault = ROOT / "tests" / "fixtures" / "rank_fault"
    done = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--env", f"PYTHONPATH={fault}",
                "--env", "TEST_RANK_FAULT=raise", cwd=project, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    final = done.stdout.strip().splitlines()[-1]
    assert re.search(r"^\[orch\] failed after [\d.]+ s: node 1 exited with code 1: .*ValueError: a bug in the training "
                     r"code at step 3$", final), done.stdout[-3000:]  # fmt: skip
    assert "orch exits 75" not in done.stdout
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", done.stdout, re.M).group(1)
    record = json.loads((output_dir / "orch" / "early-exit" / "rank1.json").read_text())
    assert record["error"] == "rank 1 (node 1) failed at step 3: ValueError: a bug in the training code at step 3"
    assert not (output_dir / "orch" / "early-exit" / "rank0.json").exists()  # its network error is not a cause


# ---------------------------------------------------------------- a node that never joins


def test_head_names_the_node_that_never_joined(node_env):
    # CPU processes: this machine's torch is a CPU build, which a GPU node refuses before its barrier
    env = node_env(2, 8, 0, ORCH_RENDEZVOUS_TIMEOUT="1.5", ORCH_BARRIER_PORT=str(free_port()), ORCH_DEVICE="cpu")
    started = time.monotonic()
    result = orch("node", env=env, timeout=60)
    assert result.returncode == 75 and time.monotonic() - started < 30
    assert "orch: error: node(s) 1 never joined the head within 1.5 s" in result.stderr
    assert "Traceback" not in result.stderr


def test_worker_says_the_head_is_unreachable(node_env):
    port = free_port()
    env = node_env(2, 8, 1, ORCH_RENDEZVOUS_TIMEOUT="1", ORCH_BARRIER_PORT=str(port), ORCH_DEVICE="cpu")
    env["SKYPILOT_NODE_IPS"] = "127.0.0.1\n127.0.0.2\n"
    result = orch("node", env=env, timeout=60)
    assert result.returncode == 75
    assert f"orch: error: node 1 could not reach the head node 127.0.0.1:{port} within 2 s" in result.stderr


@pytest.mark.e2e
def test_local_run_with_a_node_that_never_joins_fails_fast(project):
    recipe = project / "recipes" / "late.yaml"
    recipe.write_text(
        (project / "recipes" / "phi3_dpo_fsdp.yaml")
        .read_text()
        .replace("\n  orch node\n", '\n  if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 300; fi\n  orch node\n')
    )
    started = time.monotonic()
    result = orch(
        "run",
        "late",
        "--local",
        "--nodes",
        "2",
        "--smoke",
        "--env",
        "ORCH_RENDEZVOUS_TIMEOUT=3",
        cwd=project,
        timeout=120,
    )
    assert result.returncode == 75 and time.monotonic() - started < 60
    assert "(node0) orch: error: node(s) 1 never joined the head within 3 s" in result.stdout


# ---------------------------------------------------------------- bad input, through the real CLI

BROKEN = {
    "broken_yaml.yaml": "name: [unclosed\n",
    "no_envs.yaml": "resources:\n  accelerators: A100:8\nrun: orch node\n",
    "missing_trl.yaml": None,  # phi3 recipe pointing at a TRL config that does not exist
    "bad_trl_key.yaml": None,  # phi3 recipe whose TRL config has a misspelt key
}

BAD_INPUT = [
    (["run", "broken_yaml"], "recipe recipes/broken_yaml.yaml is not valid YAML at line"),
    (["run", "nope"], "unknown recipe 'nope'"),
    (["run", "phi3_dpo_fsd"], "did you mean phi3_dpo_fsdp?"),
    (["run", "no_envs"], "has no `envs:` mapping"),
    (["run", "missing_trl"], "TRL_CONFIG=recipes/trl/missing.yaml (from recipes/missing_trl.yaml) does not exist"),
    (["run", "bad_trl_key"], "has no argument 'lerning_rate'; did you mean learning_rate?"),
    (["run", "phi3_dpo_fsdp", "--gpus", "A100:0"], "the GPU count must be a positive integer"),
    (["run", "phi3_dpo_fsdp", "--gpus", "A100:x"], "the count 'x' is not a whole number"),
    (["run", "phi3_dpo_fsdp", "--gpus", ":8"], "missing accelerator name"),
    (["run", "phi3_dpo_fsdp", "--nodes", "0"], "--nodes 0: a run needs at least 1 node"),
    (["run", "phi3_dpo_fsdp", "--nodes", "two"], "argument --nodes/--num-nodes: invalid int value"),
    (["run", "phi3_dpo_fsdp", "--gpus", "Z999:8"], "unknown accelerator 'Z999'"),
    (["run", "phi3_dpo_fsdp", "lerning_rate=1e-5"], "did you mean learning_rate?"),
    (["run", "phi3_dpo_fsdp", "max_steps=ten"], "max_steps takes an integer"),
    (["run", "phi3_dpo_fsdp", "dtype=fp8"], "dtype takes one of auto, bfloat16, float16, float32"),
    (["run", "phi3_dpo_fsdp", "--nodes", "3"], "GLOBAL_BATCH_SIZE=64 is not a multiple of"),
    (["run", "qwen25_grpo_ddp", "num_generations=7"], "not a multiple of num_generations=7"),
    (["run", "qwen25_kto_ddp", "per_device_train_batch_size=1"], "KTO needs per_device_train_batch_size >= 2"),
    (["run", "phi3_dpo_fsdp", "--env", "X=$(reboot)"], "--env X= holds shell metacharacter(s) $"),
    (["run", "phi3_dpo_fsdp", "--env", "X=a\nb"], "--env X= holds a newline"),
    (["run", "phi3_dpo_fsdp", "--env", "1X=2"], "--env '1X': not an environment variable name"),
    (["run", "phi3_dpo_fsdp", "run_name=a;rm -rf ~"], "override run_name= holds shell metacharacter(s) ;"),
    (["run", "phi3_dpo_fsdp", "run_name=a`id`"], "holds shell metacharacter(s) `"),
    (["run", "phi3_dpo_fsdp", "run_name=a\nb"], "override run_name= holds a newline"),
    (["run", "phi3_dpo_fsdp", "--env", "TRL_TRAINER=ppo"], "TRL_TRAINER='ppo' is not a trainer orch runs"),
    (["run", "phi3_dpo_fsdp", "--local", "--gpus", "A100:2"], "--local runs CPU processes; use --gpus CPU:2"),
    (
        ["run", "phi3_dpo_fsdp", "--smoke"],
        "--smoke trains the recipe's tiny model: on this machine (--local) or on CPU nodes (--gpus none)",
    ),
    (["run", "phi3_dpo_fsdp", "--local", "--managed"], "--managed: for SkyPilot launches, not --local"),
    (["run", "phi3_dpo_fsdp", "--cluster", "bad name!"], "--cluster 'bad name!'"),
    (["run", "phi3_dpo_fsdp", "--idle-minutes", "-1"], "--idle-minutes -1: give 0 or more minutes"),
    (["run", "phi3_dpo_fsdp", "--secret", "1BAD"], "'1BAD' is not an environment variable name"),
    (
        ["run", "phi3_dpo_fsdp", "--secret", "ORCH_TEST_UNSET_TOKEN"],
        "ORCH_TEST_UNSET_TOKEN is not set in your environment",
    ),
    (["run", "llama3_sft_fsdp"], "recipe needs secret HF_TOKEN: pass --secret HF_TOKEN"),
    (["run", "llama3_sft_zero3", "--secret", "HF_TOKEN=x", "--env", "ACCELERATE_CONFIG=multi_gpu"], "needs ~90.7 GiB"),
    (["run", "phi3_dpo_fsdp", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["run", "phi3_dpo_fsdp", "notanoverride"], "override 'notanoverride' is not key=value"),
    (["cp", "phi3_dpo_fsdp", "qwen25_sft_ddp"], "recipes/qwen25_sft_ddp.yaml already exists; pass --force"),
    (["logs", "no-such-run"], "no run 'no-such-run' in sky_jobs/"),
    (["show", "phi3_dpo_fsdp", "betta=1"], "did you mean beta?"),
]


@pytest.fixture
def broken_project(project):
    recipes = project / "recipes"
    phi3 = (recipes / "phi3_dpo_fsdp.yaml").read_text()
    (recipes / "broken_yaml.yaml").write_text(BROKEN["broken_yaml.yaml"])
    (recipes / "no_envs.yaml").write_text(BROKEN["no_envs.yaml"])
    (recipes / "missing_trl.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/missing.yaml"))
    (recipes / "trl" / "typo.yaml").write_text(
        (recipes / "trl" / "phi3_dpo.yaml").read_text().replace("learning_rate:", "lerning_rate:")
    )
    (recipes / "bad_trl_key.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/typo.yaml"))
    return project


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a)[:60] for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(broken_project, argv, message):
    before = sorted(p.relative_to(broken_project) for p in broken_project.rglob("*"))
    result = orch(*argv, cwd=broken_project, env={"ORCH_TEST_UNSET_TOKEN": ""}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert sorted(p.relative_to(broken_project) for p in broken_project.rglob("*")) == before  # nothing written


def test_bad_node_environment_through_the_cli(node_env):
    result = orch("node", "--print", env=node_env(2, 8, 2))
    assert result.returncode == 2 and result.stderr.strip() == (
        "orch: error: SKYPILOT_NODE_RANK=2 is outside 0..1 (SKYPILOT_NUM_NODES=2)"
    )


@pytest.mark.parametrize("head_ip", ["127.0.0.1", "::1"])
def test_barrier_listens_on_ipv4_and_ipv6(head_ip):
    import socket
    import threading

    from orchestrator.node import barrier

    if head_ip == "::1":
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
    port = free_port()
    done = []
    head = threading.Thread(target=lambda: done.append(barrier.head_wait(2, port, 20)))
    head.start()
    assert barrier.worker_join(1, head_ip, port, 20) < 20
    head.join(timeout=20)
    assert done, "the head did not release the worker"


@pytest.mark.parametrize("ips", ["not an ip\n127.0.0.1\n", "10.0.0.1\n10.0.0.256\n", "fe80::1::2\n10.0.0.1\n"])
def test_node_addresses_must_be_ip_addresses(node_env, ips):
    result = orch("node", "--print", env={**node_env(2, 8, 0), "SKYPILOT_NODE_IPS": ips})
    assert result.returncode == 2 and "is not an IPv4 or IPv6 address" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_ipv6_node_addresses_are_accepted(node_env):
    result = orch("node", "--print", env={**node_env(2, 8, 1), "SKYPILOT_NODE_IPS": "fd00::1\nfd00::2\n"})
    assert result.returncode == 0, result.stderr
    assert "--main_process_ip fd00::1" in result.stdout


def test_a_node_that_does_not_exit_after_another_finished_is_named_and_stopped(tmp_path):
    """A node launcher stopped (SIGSTOP) after training: once one node finished, the others have
    ORCH_NODE_EXIT_WAIT seconds; the late one is named (stopped), ended with its process group, and the run fails."""
    from orchestrator.launch.backends.local import run_nodes

    script = 'if [ "$NODE" = 1 ]; then kill -STOP $$; fi; echo "node $NODE done"'
    envs = [{"NODE": "0", "ORCH_NODE_EXIT_WAIT": "2", "ORCH_STOP_GRACE": "2"},
            {"NODE": "1", "ORCH_NODE_EXIT_WAIT": "2", "ORCH_STOP_GRACE": "2"}]  # fmt: skip
    sink = __import__("io").StringIO()
    began = time.monotonic()
    result = run_nodes(script, envs, tmp_path, sink=sink)
    assert time.monotonic() - began < 30, sink.getvalue()
    assert result.returncode != 0 and result.failed_node == 1
    assert result.error == ("orch: error: node 1 did not exit 2 s after node 0 finished its training, which is "
                            "stopped (SIGSTOP, or a debugger) (ORCH_NODE_EXIT_WAIT=2)"), sink.getvalue()  # fmt: skip
