"""Where `orch node` runs: SkyPilot, Slurm (srun), Kubeflow's PyTorchJob and torchrun-style variables,
each read by its own pure detector into the same topology, then the same argv contract and the same checks."""

import pytest
from conftest import check_snapshot, orch

from orchestrator.core.errors import OrchError
from orchestrator.node import env as node_env_module
from orchestrator.node import plan as node

pytestmark = pytest.mark.unit

FSDP = {"distributed_type": "FSDP"}
TRL = {"per_device_train_batch_size": 2}
RECIPE = {
    "TRL_TRAINER": "dpo",
    "TRL_CONFIG": "recipes/trl/phi3_dpo.yaml",
    "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_phi3.yaml",
    "GLOBAL_BATCH_SIZE": "96",  # 96 = 2 per device x 1, 16 or 12 ranks x accumulation
}


def skypilot(nodes, gpus, rank):
    ips = "".join(f"10.0.0.{i + 1}\n" for i in range(nodes))
    return {"SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": str(nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus)}  # fmt: skip


def slurm(nodes, gpus, rank):
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": ",".join(f"gpu-{i + 1:02d}" for i in range(nodes)),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(rank),
            "SLURM_PROCID": str(rank), "SLURM_GPUS_ON_NODE": str(gpus)}  # fmt: skip


def kubeflow(nodes, gpus, rank):
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(gpus), "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "train-master-0", "PET_MASTER_PORT": "23456"}  # fmt: skip


def torchrun(nodes, gpus, rank):
    return {"MASTER_ADDR": "10.1.0.5", "MASTER_PORT": "29400", "NODE_RANK": str(rank), "NNODES": str(nodes),
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}  # fmt: skip


ENVIRONMENTS = {"SkyPilot": skypilot, "Slurm": slurm, "Kubeflow": kubeflow, "torchrun": torchrun}


@pytest.mark.parametrize("source", ENVIRONMENTS)
@pytest.mark.parametrize("nodes, gpus", [(1, 1), (2, 8), (3, 4)])
def test_every_environment_gives_the_same_contract(source, nodes, gpus):
    lines = []
    for rank in range(nodes):
        env = {**RECIPE, **ENVIRONMENTS[source](nodes, gpus, rank)}
        assert node_env_module.detect(env) == source
        plan = node.plan(env, FSDP, TRL)
        argv = plan.argv
        assert argv[argv.index("--num_processes") + 1] == str(nodes * gpus)
        assert argv[argv.index("--num_machines") + 1] == str(nodes)
        assert argv[argv.index("--machine_rank") + 1] == str(rank)
        assert plan.gradient_accumulation_steps == 96 // (2 * nodes * gpus)
        lines.append(node.describe(plan.cluster))
        lines.append(" ".join(argv))
    check_snapshot(f"env_{source.lower()}_{nodes}x{gpus}.txt", "\n".join(lines) + "\n")


def test_skypilot_comes_first_where_it_runs_on_slurm_or_kubernetes():
    """SkyPilot on Slurm or Kubernetes leaves the scheduler's variables in the environment too."""
    env = {**RECIPE, **slurm(2, 8, 1), **torchrun(2, 8, 0), **kubeflow(4, 8, 3), **skypilot(2, 8, 0)}
    cluster = node.plan(env, FSDP, TRL).cluster
    assert (cluster.source, cluster.node_rank, cluster.head_ip, cluster.port) == ("SkyPilot", 0, "10.0.0.1", 0)
    mixed = {**RECIPE, **slurm(2, 8, 1), "MASTER_ADDR": "10.9.9.9", "NODE_RANK": "0"}  # Slurm before torchrun
    assert node.plan(mixed, FSDP, TRL).cluster.source == "Slurm"


def test_slurm_host_ranges_are_expanded_by_slurm():
    env = {**slurm(3, 4, 2), "SLURM_JOB_NODELIST": "gpu-[07-08],cpu1"}
    asked = []

    def expand(nodelist):
        asked.append(nodelist)
        return ["gpu-07", "gpu-08", "cpu1"]

    cluster = node_env_module.slurm(env, expand=expand)
    assert asked == ["gpu-[07-08],cpu1"] and cluster.node_ips == ("gpu-07", "gpu-08", "cpu1")
    assert cluster.head_ip == "gpu-07" and cluster.node_rank == 2


def test_gpu_count_sources():
    slurm_env = {**slurm(2, 8, 0)}
    del slurm_env["SLURM_GPUS_ON_NODE"]
    assert node_env_module.slurm({**slurm_env, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}).gpus_per_node == 4
    assert node_env_module.slurm({**slurm_env, "ORCH_GPUS_PER_NODE": "2"}).gpus_per_node == 2
    with pytest.raises(OrchError, match="this node's GPU count is unknown: set ORCH_GPUS_PER_NODE"):
        node_env_module.slurm(slurm_env)


@pytest.mark.parametrize(
    "env, message",
    [
        (slurm(2, 8, 2), "SLURM_NODEID=2 is outside 0..1 (SLURM_JOB_NUM_NODES=2)"),
        ({**slurm(2, 8, 0), "SLURM_JOB_NODELIST": "gpu-01"}, "SLURM_JOB_NODELIST lists 1 address(es)"),
        ({**slurm(2, 8, 0), "SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
        (kubeflow(2, 8, 5), "PET_NODE_RANK=5 is outside 0..1 (PET_NNODES=2)"),
        ({**kubeflow(2, 8, 0), "PET_MASTER_ADDR": ""}, "PET_MASTER_ADDR is not set"),
        ({**kubeflow(2, 8, 0), "PET_NNODES": "1:4"}, "PET_NNODES='1:4' is an elastic range"),
        ({**kubeflow(2, 8, 0), "PET_MASTER_PORT": "99999"}, "PET_MASTER_PORT='99999' is not a TCP port"),
        (torchrun(3, 4, 3), "NODE_RANK=3 is outside 0..2 (NNODES=3)"),
        ({**torchrun(2, 4, 0), "MASTER_ADDR": "bad host!"}, "MASTER_ADDR: 'bad host!' is not an IPv4"),
        ({"TRL_TRAINER": "dpo"}, "no cluster environment here: `orch node` runs where SkyPilot"),
    ],
)
def test_an_inconsistent_environment_is_one_line_and_exit_2(env, message):
    result = orch("node", "--print", env={**RECIPE, **env})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize("source", ["Slurm", "Kubeflow", "torchrun"])
def test_print_says_which_environment(source):
    env = {**RECIPE, **ENVIRONMENTS[source](2, 8, 1), "GLOBAL_BATCH_SIZE": "64"}  # the real config: 4 per device
    result = orch("node", "--print", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"# {source}: node 1 of 2, 8 process(es) per node, head ")


def test_a_vllm_server_node_needs_every_nodes_address():
    env = {**RECIPE, **kubeflow(2, 8, 0), "TRL_TRAINER": "grpo", "TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml",
           "VLLM_SERVER_NODES": "1"}  # fmt: skip
    with pytest.raises(OrchError, match="a vLLM server node needs its own address"):
        node.plan(env, {"distributed_type": "MULTI_GPU"}, {"per_device_train_batch_size": 2})


def test_skypilot_cpu_nodes_run_one_process_each_or_what_orch_gpus_per_node_says():
    """`sky launch --gpus none` (a CPU cluster, as on the Slurm bed) sets SKYPILOT_NUM_GPUS_PER_NODE=0."""
    cpu = {**RECIPE, **skypilot(2, 0, 1), "ORCH_DEVICE": "cpu", "GLOBAL_BATCH_SIZE": "16"}
    assert node_env_module.from_env(cpu).gpus_per_node == 1
    assert node_env_module.from_env({**cpu, "ORCH_GPUS_PER_NODE": "3"}).gpus_per_node == 3
    with pytest.raises(OrchError, match=r"SKYPILOT_NUM_GPUS_PER_NODE=0: the task has no GPUs"):
        node_env_module.from_env({**cpu, "ORCH_DEVICE": "gpu"})


def test_checkpoint_root_under_home_is_the_accounts_home_and_orch_smoke_uses_the_tiny_model(monkeypatch, tmp_path):
    """On Slurm SkyPilot points $HOME at a per-cluster directory; `~` in CHECKPOINT_ROOT is the account's home, shared
    by the nodes and kept after the cluster. ORCH_SMOKE=on points the recipe at its tiny model (built here)."""
    import pwd

    from orchestrator.node import exec as node_exec

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    tiny = {"TRL_OVERRIDES": "model_name_or_path=/tiny"}
    monkeypatch.setattr(node_exec, "smoke_env", lambda env, build=True: {**env, **tiny})
    env = node_exec.node_env({**RECIPE, "HOME": "/x/.sky_clusters/c1", "CHECKPOINT_ROOT": "~/orch-checkpoints",
                              "ORCH_SMOKE": "on"})  # fmt: skip
    assert env["CHECKPOINT_ROOT"] == pwd.getpwuid(__import__("os").getuid()).pw_dir + "/orch-checkpoints"
    assert env["TRL_OVERRIDES"] == "model_name_or_path=/tiny"
    assert node_exec.node_env({**RECIPE, "CHECKPOINT_ROOT": "/shared/ckpt"})["CHECKPOINT_ROOT"] == "/shared/ckpt"
    with pytest.raises(OrchError, match="ORCH_SMOKE='maybe': ORCH_SMOKE takes on or off"):
        node_exec.node_env({**RECIPE, "ORCH_SMOKE": "maybe"})


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ORCH_RUN_ID": "phi3-dpo-fsdp-1123", "SKYPILOT_TASK_ID": "sky-2026-11-23_c1_2"}, "phi3-dpo-fsdp-1123"),
        ({"SKYPILOT_TASK_ID": "sky-2026-11-23-22-05-18-465711_phi3_1"}, "sky-2026-11-23-22-05-18-465711_phi3_1"),
        ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
        ({}, ""),
    ],
)
def test_the_run_id_that_keys_checkpoints_is_orchs_name_first(env, expected):
    # orch's run name survives a relaunch (`orch run --resume`); SkyPilot's task id is new at every `sky launch`
    assert node_env_module.run_id(env) == expected


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "a b", "x" * 129, "run;rm -rf ~"])
def test_a_run_id_that_is_no_plain_directory_name_is_refused(bad):
    with pytest.raises(OrchError, match="keys a checkpoint directory"):
        node_env_module.run_id({"ORCH_RUN_ID": bad})
    args = {**RECIPE, **skypilot(2, 8, 0), "CHECKPOINT_ROOT": "/ckpt", "ORCH_RUN_ID": bad}
    with pytest.raises(OrchError, match="keys a checkpoint directory"):
        node.plan(args, FSDP, TRL)


def test_smoke_on_a_node_keeps_the_runs_own_schedule_and_the_tiny_artifacts(monkeypatch, tmp_path):
    # `orch run --gpus none --smoke max_steps=400` reaches the node as TRL_OVERRIDES: the run's length and saves are
    # its own (as with --local --smoke); the model, data and batch stay the tiny ones even where the recipe set them.
    from orchestrator.core import overrides, smoke
    from orchestrator.node import exec as node_exec

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smoke, "ensure", lambda artifacts: None)  # the build itself is tested by the smoke runs
    given = "max_steps=400 save_steps=20 dataset_name=/mine per_device_train_batch_size=4 max_length=2048"
    words = overrides.loads(node_exec.smoke_env({**RECIPE, "TRL_OVERRIDES": given})["TRL_OVERRIDES"])
    assert (words["max_steps"], words["save_steps"]) == ("400", "20") and words["max_length"] != "2048"
    assert words["dataset_name"].startswith(str(tmp_path)) and words["per_device_train_batch_size"] == "1"
    plain = overrides.loads(node_exec.smoke_env(dict(RECIPE))["TRL_OVERRIDES"])
    assert (plain["max_steps"], plain["save_steps"]) == (str(smoke.STEPS), "4")


@pytest.mark.parametrize("last, hint", [
    ("ModuleNotFoundError: No module named 'transformers'", True),
    ("PermissionError: [Errno 13] Permission denied: '/shared/.cache/orch/smoke'", False),
])
def test_a_failed_smoke_build_quotes_its_error_and_blames_the_stack_only_when_it_is_missing(monkeypatch, tmp_path,
                                                                                            last, hint):
    import subprocess

    from orchestrator.core import smoke

    plan = smoke.SmokePlan("phi3", "dpo", tmp_path / "smoke" / "phi3-dpo-0123456789ab")
    failed = subprocess.CompletedProcess([], 1, "", f"Traceback (most recent call last):\n  ...\n{last}\n")
    monkeypatch.setattr(smoke.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(OrchError) as raised:
        smoke.ensure(plan)
    said = str(raised.value)
    assert said.startswith(f"building the smoke model failed: {last}")
    assert ("is the training stack installed?" in said) is hint, said


def test_nodes_sharing_a_home_build_the_smoke_model_once(monkeypatch, tmp_path, capsys):
    """Every node of a Slurm account shares its home and so the smoke cache: a node whose model another node (the head's
    rehearsal) is building waits for that build and uses it, in `orch node` (smoke.ensure) and in the builder itself,
    instead of building the same model into the same place at once. Without locks on the filesystem it builds."""
    import errno
    import threading

    from orchestrator.core import smoke
    from orchestrator.train import smoke_build

    plan = smoke.SmokePlan("phi3", "dpo", tmp_path / "smoke" / "phi3-dpo-0123456789ab")
    for ours in ("ensure", "build"):
        holding, finish = threading.Event(), threading.Event()

        def other_node(holding=holding, finish=finish) -> None:  # its own open file: its flock conflicts with ours
            with smoke.builder_lock(plan.dir):  # as another node's would
                holding.set()
                finish.wait(10)
                plan.dir.mkdir(parents=True)
                (plan.dir / "READY").write_text("{}")

        builder = threading.Thread(target=other_node)
        builder.start()
        assert holding.wait(10)
        threading.Timer(0.3, finish.set).start()
        with monkeypatch.context() as m:
            m.setattr(smoke.subprocess, "run", lambda *a, **k: pytest.fail("built a second time"))
            m.setattr(smoke_build, "_build", lambda *a, **k: pytest.fail("built a second time"))
            if ours == "ensure":
                smoke.ensure(plan)
                out = capsys.readouterr().out
                assert f"waiting for another process building {plan.dir}" in out and "cached at" in out, out
            else:
                assert smoke_build.build("phi3", "dpo", plan.dir) is False
        builder.join()
        assert finish.is_set()  # we returned only after the other build ended
        (plan.dir / "READY").unlink()
        plan.dir.rmdir()

    built = []
    monkeypatch.setattr(smoke.fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    monkeypatch.setattr(smoke_build, "_build", lambda *args: built.append(args))
    assert smoke_build.build("phi3", "dpo", plan.dir) is True and len(built) == 1


def test_caches_go_to_the_accounts_home_where_skypilot_gives_each_cluster_its_own(monkeypatch):
    """SkyPilot on Slurm points $HOME at <account home>/.sky_clusters/<cluster>, deleted with the cluster: the Hugging
    Face and orch caches default to the account's home there (a new cluster finds the model, the smoke artifacts and
    the rehearsal); a value of the user's own wins, and any other $HOME changes nothing."""
    from orchestrator.core import home

    monkeypatch.setattr(home, "account_home", lambda: "/home/ada/")
    per_cluster = {"HOME": "/home/ada/.sky_clusters/c-1a2b"}
    assert home.shared_caches(per_cluster) == {
        "HF_HOME": "/home/ada/.cache/huggingface",
        "ORCH_CACHE_DIR": "/home/ada/.cache/orch",
    }
    assert home.shared_caches({**per_cluster, "HF_HOME": "/data/hf"}) == {"ORCH_CACHE_DIR": "/home/ada/.cache/orch"}
    elsewhere = ("/home/ada", "/home/ada/.sky_clusters", "/home/bob/.sky_clusters/c-1", "/home/ada.sky_clusters/x")
    for home_dir in elsewhere:
        assert home.shared_caches({"HOME": home_dir}) == {}
    assert home.shared_caches({}) == {}
