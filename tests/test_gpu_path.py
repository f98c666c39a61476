"""What breaks on GPUs, checked before a GPU is paid for.

Every recipe's GPU launch is pushed through the owners' code by the rehearsal (orchestrator/rehearse_role.py):
accelerate's launch parser, config merge and env builders, torchrun's own env rules, TRL's parser and trainer
under a fake process group of the launch's world size, transformers' DeepSpeed config finalization and its
`save_model`. The tests here fail when one of the fixes they cover is reverted.
"""

import importlib.metadata
import re
import shlex
import tempfile
from pathlib import Path

import pytest
import sky
import tomllib
import yaml
from conftest import ROOT, orch

from orchestrator.core import accelerate_schema, smoke, trl_schema
from orchestrator.core.errors import OrchError
from orchestrator.launch import recipe as recipes
from orchestrator.launch import storage
from orchestrator.launch.resolved import resolve
from orchestrator.node import plan as node
from orchestrator.rehearsal import driver as rehearsal

# each rehearsal imports the training stack in a subprocess (~5-10 s); one pytest-xdist worker runs the module, so
# that the module-scoped `rehearsed` fixture runs once
pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("test_gpu_path")]  # the rehearsed ones: e2e
# the rehearsed roles' output_dir, in the session's temporary directory (tests/conftest.py)
REHEARSAL_OUT = str(Path(tempfile.gettempdir()) / "orch-test-rehearsal")
TASKS = sorted(p for p in (ROOT / "recipes").glob("*.yaml"))


def launch_of(name: str, root=ROOT, **flags):
    return resolve(recipes.load(str(root / "recipes" / f"{name}.yaml")), **flags)


def substitutions(launch, out: str) -> list[str]:
    artifacts = smoke.plan(str(launch.setting("model_name_or_path")), launch.trainer)
    smoke.ensure(artifacts)
    return rehearsal.substitutions(launch.trainer, launch.settings, artifacts.dir, out)


def rehearse(name: str, nodes: int, gpus: int, cpus: int | None = None, envs: dict | None = None, strip=()):
    """Rehearse every role of `name` at nodes x gpus, as the nodes would plan it (with `cpus` cores each)."""
    plans, batch = rehearsal_batch(name, nodes, gpus, cpus, envs, strip)
    return plans, rehearsal.rehearse_batches([batch], ROOT)[0]


def rehearsal_batch(name: str, nodes: int, gpus: int, cpus: int | None = None, envs: dict | None = None, strip=()):
    launch = launch_of(name, nodes=nodes, envs=envs)
    base = {**launch.env(), "SKYPILOT_TASK_ID": "rehearsal"}
    base.update(
        SKYPILOT_NODE_IPS="".join(f"10.0.0.{i + 1}\n" for i in range(nodes)),
        SKYPILOT_NUM_NODES=str(nodes),
        SKYPILOT_NUM_GPUS_PER_NODE=str(gpus),
    )
    plans = [node.plan({**base, "SKYPILOT_NODE_RANK": str(r)}, *launch.paired, cpus=cpus) for r in range(nodes)]
    roles = [rehearsal.Role(name, _strip(p.argv, strip), p.env, p.role) for name, p in rehearsal.roles(plans)]
    subs = substitutions(launch, REHEARSAL_OUT)
    return plans, rehearsal.roles_batch(launch.trainer, roles, subs, gpus)


def _strip(argv: list[str], flags) -> list[str]:
    """argv without the launcher flags named (and their values), to show what the owners' code does without them."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word in flags and i < argv.index("--module"):
            skip = True
            continue
        out.append(word)
    return out


def ok(outcomes):
    assert outcomes and all(o.ok for o in outcomes), [(o.role, o.stage, o.error) for o in outcomes if not o.ok]
    return outcomes[0].facts


# ---------------------------------------------------------------- the acceptance: dry runs the owners accept


def dry_run_argvs(recipe: str, *flags: str) -> tuple[list[list[str]], str]:
    result = orch("run", recipe, *flags, "--dry-run", "--skip-optimizer", "--secret", "HF_TOKEN=x")
    assert result.returncode == 0, result.stderr
    lines = [x.split(": ", 1)[1] for x in result.stdout.splitlines() if re.match(r"^rank \d+: ", x)]
    return [shlex.split(x) for x in lines], result.stdout


def dry_run_batch(recipe: str, flags: list[str]):
    """The dry run's argv of ranks 0 and 1, as a rehearsal batch (with the dry run's output)."""
    argvs, out = dry_run_argvs(recipe, *flags)
    launch = launch_of(recipe)
    subs = substitutions(launch, REHEARSAL_OUT)
    gpus = int(flags[1].split(":")[1]) if flags else launch.gpus.count
    roles = [rehearsal.Role(f"rank {rank}", argv) for rank, argv in enumerate(argvs[:2])]
    return argvs, out, rehearsal.roles_batch(launch.trainer, roles, subs, gpus)


def packing_cp_batch():
    """Rank 0 of the context-parallel recipe's dry run, with packing turned back on."""
    argvs, _ = dry_run_argvs("qwen3_sft_fsdp_cp")
    subs = substitutions(launch_of("qwen3_sft_fsdp_cp"), REHEARSAL_OUT) + ["--packing", "true"]
    return rehearsal.roles_batch("sft", [rehearsal.Role("rank 0", argvs[0])], subs, 8)


DRY_RUNS = [
    ("qwen3_sft_zero1", ["--gpus", "A10G:8"]),
    ("qwen3_sft_fsdp_cp", []),
    ("phi3_dpo_fsdp", []),
    ("llama3_sft_fsdp", []),
]
REHEARSED = [  # rehearsal_batch's arguments, as the tests below call rehearse()
    ("qwen3_sft_zero1", 1, 8, None, None, ("--gradient_accumulation_steps",)),
    ("llama3_sft_zero3", 2, 8),
    ("llama3_sft_zero3_offload", 1, 8, 96),
    ("llama3_sft_zero3", 1, 8, 96),
    ("qwen3_sft_alst", 2, 8),
    ("llama3_sft_lora_ddp", 1, 8),
    ("llama3_dpo_lora_ddp", 1, 8),
]


@pytest.fixture(scope="module")
def rehearsed():
    """This module's rehearsals in one call of 2 processes, each importing the training stack once, instead of one
    process per test; the tests find theirs in the session's rehearsal cache (same batch, same key). A test whose
    arguments no longer match an entry here still passes: it rehearses on its own, slower."""
    batches = [rehearsal_batch(*spec)[1] for spec in REHEARSED]
    batches += [dry_run_batch(recipe, flags)[2] for recipe, flags in DRY_RUNS] + [packing_cp_batch()]
    rehearsal.rehearse_batches(batches, ROOT, parallel=2)


@pytest.mark.parametrize("recipe, flags", DRY_RUNS)
@pytest.mark.e2e
def test_dry_run_argv_is_accepted_by_accelerate_trl_and_transformers(rehearsed, recipe, flags):
    """Each rank of the dry run, through accelerate's launcher and TRL's trainer; DeepSpeed's config finalized by
    transformers and the final model saved, as the end of train() would."""
    argvs, out, batch = dry_run_batch(recipe, flags)
    gpus = batch.devices
    for rank, outcome in enumerate(rehearsal.rehearse_batches([batch], ROOT)[0]):
        assert outcome.ok, (outcome.stage, outcome.error)
        facts = outcome.facts
        assert facts["world_size"] == len(argvs) * gpus and facts["rank"] == rank * gpus
        ga = int(re.search(r"x (\d+) accumulation steps", out).group(1))
        assert facts["gradient_accumulation_steps"] == ga
        if "fsdp" in recipe:
            # recipes keep sharded checkpoints; the final model is gathered whole (transformers writes nothing
            # from a sharded state dict) and saved by transformers' own save_model
            assert facts["distributed_type"] == "FSDP" and facts["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
            assert facts["final_model"] == "full state dict"
        else:
            assert facts["distributed_type"] == "DEEPSPEED" and facts["zero_stage"] == 1


# ---------------------------------------------------------------- DeepSpeed: one accumulation for all


@pytest.mark.e2e
def test_without_the_accelerate_flag_transformers_refuses_zero1(rehearsed):
    """What the flag fixes, shown by the owners' code: TRL's zero1 profile's accumulation 1 reaches DeepSpeed."""
    _, outcomes = rehearse("qwen3_sft_zero1", 1, 8, strip=("--gradient_accumulation_steps",))
    (outcome,) = outcomes
    assert not outcome.ok and outcome.stage == "transformers' DeepSpeed config"
    assert "ds gradient_accumulation_steps=1 vs hf gradient_accumulation_steps=4" in outcome.error


@pytest.mark.e2e
def test_deepspeed_config_pinning_another_accumulation_gets_orchs(project, monkeypatch):
    """An edited copy whose Accelerate config pins gradient_accumulation_steps: 2 where the batch needs 8."""
    monkeypatch.chdir(project)
    assert orch("cp", "qwen25_dpo_zero2", "my_zero2", cwd=project).returncode == 0
    accel = project / "recipes" / "accelerate" / "my_zero2.yaml"
    config = yaml.safe_load(accel.read_text())
    config["deepspeed_config"]["gradient_accumulation_steps"] = 2
    accel.write_text(yaml.safe_dump(config))
    argvs, out = dry_run_argvs_in(project, "my_zero2", "--gpus", "A100:1", "--nodes", "2")
    assert "x 8 accumulation steps" in out
    subs = substitutions(launch_of("my_zero2", root=project), REHEARSAL_OUT)
    (outcome,) = rehearsal.rehearse_roles("dpo", [rehearsal.Role("rank 1", argvs[1])], subs, 1, project)
    assert outcome.ok, outcome.error
    assert outcome.facts["gradient_accumulation_steps"] == 8 and outcome.facts["zero_stage"] == 2


def dry_run_argvs_in(project, recipe: str, *flags: str):
    result = orch("run", recipe, *flags, "--dry-run", "--skip-optimizer", cwd=project)
    assert result.returncode == 0, result.stderr
    lines = [x.split(": ", 1)[1] for x in result.stdout.splitlines() if re.match(r"^rank \d+: ", x)]
    return [shlex.split(x) for x in lines], result.stdout


@pytest.mark.e2e
def test_zero3_recipes_write_a_loadable_final_model(rehearsed):
    facts = ok(rehearse("llama3_sft_zero3", 2, 8)[1])
    assert facts["zero_stage"] == 3 and facts["final_model"].startswith("16-bit weights")
    accel = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}
    message = r"ZeRO-3 without 16-bit gathering on save .*deepspeed_config\.zero3_save_16bit_model: true"
    with pytest.raises(OrchError, match=message):
        node.plan(env(1, 8), accel, {"per_device_train_batch_size": 1})


def env(nodes, gpus, rank=0, **extra):
    return {
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        "SKYPILOT_NODE_IPS": "".join(f"10.2.0.{i + 1}\n" for i in range(nodes)),
        "TRL_TRAINER": "sft",
        "TRL_CONFIG": "t.yaml",
        "ACCELERATE_CONFIG": "a.yaml",
        **extra,
    }


# ---------------------------------------------------------------- context parallelism without packing


@pytest.mark.e2e
def test_trl_refuses_packing_with_context_parallelism_and_so_does_orch(rehearsed):
    """TRL's own check fires in the rehearsal; orch's node plan refuses the same earlier, on the laptop."""
    (outcome,) = rehearsal.rehearse_batches([packing_cp_batch()], ROOT)[0]
    assert not outcome.ok and "Packing is not compatible with context parallelism" in outcome.error
    result = orch("run", "qwen3_sft_fsdp_cp", "packing=true", "--dry-run", "--skip-optimizer")
    assert result.returncode == 2 and result.stdout == ""
    assert "TRL's SFTTrainer refuses packing with context parallelism (cp_size=2)" in result.stderr
    assert "set packing=false" in result.stderr


# ---------------------------------------------------------------- CPU threads for offload


@pytest.mark.e2e
def test_offload_gets_the_nodes_cores_not_torchruns_one_thread(rehearsed):
    plans, outcomes = rehearse("llama3_sft_zero3_offload", 1, 8, cpus=96)
    assert plans[0].env == {"OMP_NUM_THREADS": "12"}
    assert ok(outcomes)["omp_num_threads"] == "12"  # what torchrun's config_from_args passes to the processes
    _, without = rehearse("llama3_sft_zero3", 1, 8, cpus=96)  # no offload: orch leaves torchrun's default
    assert ok(without)["omp_num_threads"] == "1"
    fsdp_offload = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True}}
    assert node.plan(env(1, 4), fsdp_offload, {}, cpus=32).env == {"OMP_NUM_THREADS": "8"}
    assert node.plan(env(1, 4, OMP_NUM_THREADS="3"), fsdp_offload, {}, cpus=32).env == {}  # the recipe's own


def test_node_print_shows_the_variables_it_sets():
    result = orch(
        "node",
        "--print",
        env={
            **env(1, 8),
            "TRL_CONFIG": "recipes/trl/llama3_sft.yaml",
            "ACCELERATE_CONFIG": "recipes/accelerate/zero3_offload.yaml",
        },
    )
    assert result.returncode == 0, result.stderr
    where, command = result.stdout.split("\n", 1)
    assert where.startswith("# SkyPilot: node 0 of 1, 8 process(es) per node")
    assert re.match(r"^OMP_NUM_THREADS=\d+ accelerate launch ", command)


# ---------------------------------------------------------------- Accelerate config keys accelerate drops


def test_accelerate_drops_unknown_block_keys_and_orch_refuses_them(tmp_path):
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "alst_ulysses_sp2.yaml").read_text())
    config["deepspeed_config"]["seq_parallel_communication_data_type"] = "bf16"
    path = tmp_path / "alst.yaml"
    path.write_text(yaml.safe_dump(config))
    # accelerate's own launcher: the key never reaches the training processes' environment
    from orchestrator.rehearsal.role import accelerate_stage

    argv = ["accelerate", "launch", "--config_file", str(path), "--num_processes", "8", "--num_machines", "1",
            "--machine_rank", "0", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500",
            "--module", "orchestrator.train", "sft"]  # fmt: skip
    child, _, facts = accelerate_stage(argv)
    assert facts["path"] == "deepspeed"
    assert not [k for k, v in child.items() if "SEQ_PARALLEL_COMMUNICATION" in k or v == "bf16" and "DEEPSPEED" in k]
    with pytest.raises(OrchError, match=r"does not pass deepspeed_config.seq_parallel_communication_data_type"):
        node.plan(env(1, 8), config, {"per_device_train_batch_size": 1})


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")), ids=lambda p: p.stem)
def test_recipe_accelerate_configs_have_no_dropped_keys(path):
    accelerate_schema.check_config(yaml.safe_load(path.read_text()), str(path))


def test_accelerate_snapshot_matches_installed_accelerate():
    from orchestrator.train import snapshots

    assert accelerate_schema.SCHEMA.read_text() == accelerate_schema.render(snapshots.generate_accelerate()), (
        "orchestrator/core/accelerate_args.json is stale: run `make snapshots` and commit it"
    )


def test_torch_cuda_snapshot_matches_installed_torch_and_the_lock():
    """core/torch_cuda.json is torch's own tables (its release's CUDA builds, the devices each kernel runs on) and the
    CUDA of uv.lock's torch; core/cuda_arch.runs_on is torch's own rule, for every code it knows and one it does not."""
    import warnings

    import torch.cuda

    from orchestrator.core import cuda_arch
    from orchestrator.train import snapshots

    assert cuda_arch.SNAPSHOT.read_text() == snapshots.render_torch_cuda(snapshots.generate_torch_cuda()), (
        "orchestrator/core/torch_cuda.json is stale: run `make snapshots` and commit it"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of a code it does not know (130 here)
        for code in [*torch.cuda.DEVICE_REQUIREMENT, 130]:
            for device in range(50, 140):
                torch_says = torch.cuda._code_compatible_with_device(device, code)
                assert cuda_arch.runs_on(code, device) is torch_says, (code, device)


def test_sky_task_schema_snapshot_matches_installed_skypilot():
    from orchestrator.core import sky_schema
    from orchestrator.launch.backends import sky

    assert sky_schema.SCHEMA.read_text() == sky.task_schema_text(), (
        "orchestrator/core/sky_task_schema.json is stale: run `make snapshots` and commit it"
    )


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_passes_skypilots_task_schema_as_orch_reads_it(path):
    """The snapshot check orch runs (core/sky_schema.py) agrees with SkyPilot itself on every shipped recipe."""
    import sky

    from orchestrator.core import sky_schema

    sky_schema.check_task(yaml.safe_load(path.read_text()), str(path))
    sky.Task.from_yaml(str(path))


@pytest.mark.e2e
def test_alst_recipe_rehearses_at_two_nodes(rehearsed):
    facts = ok(rehearse("qwen3_sft_alst", 2, 8)[1])
    assert facts["parallelism"]["sp"] == 2 and facts["parallelism"]["dp_shard"] == 8


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["llama3_sft_lora_ddp", "llama3_dpo_lora_ddp"])
def test_lora_ddp_recipes_do_not_have_ddp_search_for_unused_parameters(rehearsed, name):
    """A PeftModel is not a PreTrainedModel: without ddp_find_unused_parameters in the recipe, transformers hands DDP
    find_unused_parameters=True and every step pays for a search that finds nothing (read from the accelerator the
    trainer built, as DDP will get it)."""
    assert ok(rehearse(name, 1, 8)[1])["ddp_find_unused_parameters"] is False


# ---------------------------------------------------------------- versions and package bounds


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(group: str):
    from packaging.requirements import Requirement

    return [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"][group]]


def test_nodes_install_the_versions_the_launch_side_checked_against():
    pins = {r.name: str(r.specifier) for r in _requirements("train")}
    for package, version in {**trl_schema.versions(), **accelerate_schema.schema()["versions"]}.items():
        assert pins[package] == f"=={version}", (package, pins.get(package), version)
        assert importlib.metadata.version(package) == version, package


def test_an_argument_of_a_newer_transformers_is_refused_with_the_versions_named():
    result = orch("show", "qwen25_sft_ddp", "activation_checkpointing=true")
    assert result.returncode == 2
    assert "has no TRL argument 'activation_checkpointing'" in result.stderr
    assert "TRL 1.16.0 / transformers 5.17.0, the versions the nodes install" in result.stderr


def _owner_bounds() -> dict[str, list[tuple[str, object]]]:
    """Package -> [(owner extra, specifier)] for what TRL (and transformers, through trl[kernels]) bound."""
    from packaging.requirements import Requirement

    bounds: dict[str, list] = {}
    for owner in ("trl", "transformers"):
        for text in importlib.metadata.requires(owner) or []:
            req = Requirement(text)
            extra = re.search(r'extra == "([^"]+)"', str(req.marker or ""))
            if extra and extra.group(1) not in ("dev", "test", "testing", "quality", "all", "docs"):
                bounds.setdefault(req.name, []).append((f"{owner}[{extra.group(1)}]", req.specifier))
    return bounds


@pytest.mark.parametrize("group", ["train", "gpu", "vllm"])
def test_packages_trl_bounds_come_through_trls_extras(group):
    """Our extras never widen what TRL tested: a package TRL bounds in an extra is asked for through that extra
    (pip then applies TRL's range), and a version we pin lies inside TRL's range."""
    ours = _requirements(group)
    trl_extras = {f"trl[{e}]" for r in ours if r.name == "trl" for e in r.extras}
    bounds = _owner_bounds()
    for req in ours:
        if req.name in ("trl", "transformers") or req.name not in bounds:
            continue
        owners = bounds[req.name]
        assert any(extra in trl_extras or extra.startswith("transformers[") for extra, _ in owners), (
            f"{group}: {req} widens {owners}; ask for it through trl[...]"
        )
        pinned = [str(s.version) for s in req.specifier if s.operator == "=="]
        for version in pinned:
            assert all(spec.contains(version) for extra, spec in owners if extra in trl_extras), (req, owners)
    if group in ("gpu", "vllm"):
        assert trl_extras, f"{group} should take TRL's extras"
    if group == "vllm":
        assert "trl[vllm]" in trl_extras


# ---------------------------------------------------------------- multi-node network and durable storage



@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_recipe_storage_and_network(path):
    task = sky.Task.from_yaml(str(path))
    raw = yaml.safe_load(path.read_text())
    assert storage.durable_checkpoints(raw), f"{path.stem}: checkpoints are not on a mounted bucket"
    assert "/checkpoints" in task.storage_mounts  # SkyPilot's own parser sees a bucket mount there
    assert raw["envs"]["CHECKPOINT_ROOT"] == "/checkpoints"
    if task.num_nodes > 1:
        (resources,) = list(task.resources)
        assert str(resources.network_tier.value) == "best", f"{path.stem} runs on {task.num_nodes} nodes"


def test_storage_rule_reads_mounts_and_volumes():
    base = {"envs": {"CHECKPOINT_ROOT": "/ckpt/run", "B": "mine"}}
    mounted = {**base, "file_mounts": {"/ckpt": {"name": "${B}", "mode": "MOUNT_CACHED"}}}
    assert storage.durable_checkpoints(mounted) == "bucket mine mounted at /ckpt (MOUNT_CACHED)"
    assert storage.durable_checkpoints({**base, "file_mounts": {"/ckpt": {"name": "b", "mode": "COPY"}}}) is None
    assert storage.durable_checkpoints({**base, "file_mounts": {"/ckp": {"name": "b"}}}) is None
    assert storage.durable_checkpoints({**base, "volumes": {"/ckpt": "pvc-1"}}) == "volume pvc-1 mounted at /ckpt"
    assert storage.durable_checkpoints({"envs": {}}) is None


@pytest.fixture
def no_bucket(project):
    text = (project / "recipes" / "phi3_dpo_fsdp.yaml").read_text()
    text = re.sub(r"\nfile_mounts:\n(  .*\n)+", "\n", text)
    (project / "recipes" / "local_disk.yaml").write_text(text)
    return project


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--managed"], "a managed job's recovery"),
        (["--nodes", "2"], "a run on 2 nodes"),
        (["--down"], "--down"),
        (["--managed", "--nodes", "2"], "a managed job's recovery and a run on 2 nodes"),
    ],
)
def test_launch_without_durable_storage_is_refused(no_bucket, flags, reason):
    result = orch("run", "local_disk", *flags, "-y", cwd=no_bucket)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"orch: error: {reason} would lose the checkpoints and the final model")
    assert "CHECKPOINT_ROOT=/checkpoints is not a mounted bucket or volume" in line and "MOUNT_CACHED" in line
    assert not (no_bucket / "sky_jobs").exists()


def test_single_node_cluster_launch_may_keep_local_checkpoints(no_bucket):
    result = orch("run", "local_disk", "--dry-run", "--skip-optimizer", cwd=no_bucket)
    assert result.returncode == 0, result.stderr
    assert "checkpoints and final model: the nodes' own disks (lost with the cluster)" in result.stdout


def test_multi_node_launch_gets_the_best_network_tier():
    result = orch("run", "phi3_dpo_fsdp", "--nodes", "2", "--dry-run", "--skip-optimizer")
    assert result.returncode == 0, result.stderr
    assert "network_tier: best" in result.stdout
    assert re.search(
        r"checkpoints and final model: bucket orch-phi3-dpo-fsdp-[0-9a-f]{8} mounted at /check", result.stdout
    )
    single = orch("run", "phi3_dpo_fsdp", "--nodes", "1", "--dry-run", "--skip-optimizer")
    assert "network_tier" not in single.stdout
