"""Every launch rehearsed against the owners' code before a GPU is paid for.

The matrix rehearses every recipe at every topology where its global batch can be kept, and edited copies, in one
subprocess (the training stack imported once, one fork per role); its results land in the session's rehearsal
cache, which the CLI's dry runs then reuse. The rest of the suite runs with ORCH_REHEARSAL=off (conftest), so
these tests turn it on.
"""

import os
import re
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, Rehearsed, orch

from orchestrator.core import bnb, smoke
from orchestrator.core.accelerators import Gpus
from orchestrator.core.errors import OrchError
from orchestrator.launch import recipe as recipes
from orchestrator.launch.checks import previews
from orchestrator.launch.resolved import resolve
from orchestrator.rehearsal import driver

# one pytest-xdist worker runs the module: its module-scoped fixtures rehearse once
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("test_rehearsal")]
ON = {"ORCH_REHEARSAL": "on"}
TOPOLOGIES = [(1, 1), (1, 8), (2, 8), (3, 4), (16, 8)]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def default_shape(name: str) -> tuple[int, int]:
    """(num_nodes, GPUs per node) the recipe launches with when no flag resizes it."""
    recipe = recipes.load(str(ROOT / "recipes" / f"{name}.yaml"))
    return recipe.num_nodes, recipe.gpus.count


DEFAULTS = {name: default_shape(name) for name in RECIPES if default_shape(name) not in TOPOLOGIES}
MATRIX_ENVS: dict = {}  # (recipe, nodes, gpus) -> the --env the matrix needed for the batch to fit that shape


def batch_for(path, nodes: int, gpus: int, **flags):
    """The launch `orch run <path> --gpus <type>:<gpus> --nodes <nodes>` would rehearse, or None where it cannot
    run at that shape (its global batch cannot be kept, a vLLM server needs a second node)."""
    launch = resolve(recipes.load(str(path)), nodes=nodes, gpus=Gpus("H100", gpus), **flags)
    try:
        plans = previews(launch)
    except OrchError as exc:
        return str(exc)
    artifacts = smoke.plan(str(launch.setting("model_name_or_path")), launch.trainer)
    return driver.Batch(
        trainer=launch.trainer,
        roles=[driver.Role(name, p.argv, p.env, p.role) for name, p in driver.roles(plans)],
        substitute=driver.substitutions(launch.trainer, launch.settings, artifacts.dir, driver.output_dir()),
        devices=gpus,
        smoke=(artifacts.model_type, artifacts.trainer, str(artifacts.dir)),
        quantized=str(launch.settings.get("load_in_4bit", "false")).lower() == "true",
        bitsandbytes=bnb.uses(launch.setting),  # as checks.rehearse hands it: the dry runs below find it cached
    ), plans


def copies(project):
    """Edited copies made with `orch cp`: another Accelerate config, a TRL profile swapped in, DeepSpeed configs with
    an accumulation of their own (pinned in the Accelerate config; "auto" in a DeepSpeed JSON)."""
    made = {}
    # TRL's fsdp2 profile instead (on SFT: with DPO its cpu_ram_efficient_loading is refused, see
    # test_cpu_strategies.py's reference-model test)
    assert orch("cp", "llama3_sft_fsdp", "sft_profile", cwd=project).returncode == 0
    edit_env(project / "recipes" / "sft_profile.yaml", ACCELERATE_CONFIG="fsdp2")
    made["sft_profile"] = 2
    assert orch("cp", "qwen25_dpo_zero2", "zero2_pinned", cwd=project).returncode == 0
    edit_accel(project / "recipes" / "accelerate" / "zero2_pinned.yaml", gradient_accumulation_steps=2)
    made["zero2_pinned"] = 1
    assert orch("cp", "llama3_sft_zero3", "zero3_json", cwd=project).returncode == 0
    ds_json(project, "zero3_json", "auto")
    made["zero3_json"] = 2
    assert orch("cp", "qwen25_sft_ddp", "sft_zero3", cwd=project).returncode == 0
    edit_env(project / "recipes" / "sft_zero3.yaml", ACCELERATE_CONFIG="zero3")  # a strategy swapped in
    made["sft_zero3"] = 1
    # FSDP2 with CPU offload: DPO's reference model is sharded as the trainer is built, and CPUOffloadPolicy pins its
    # shards (refused on a CPU build, "Cannot access accelerator device", until the rehearsal's fake GPU pinned none)
    assert orch("cp", "phi3_dpo_fsdp", "dpo_offload", cwd=project).returncode == 0
    offload = project / "recipes" / "accelerate" / "dpo_offload.yaml"
    config = yaml.safe_load(offload.read_text())
    config["fsdp_config"]["fsdp_offload_params"] = True
    offload.write_text(yaml.safe_dump(config))
    made["dpo_offload"] = 2
    return made


def edit_env(path, **envs):
    task = yaml.safe_load(path.read_text())
    task["envs"].update(envs)
    path.write_text(yaml.safe_dump(task, sort_keys=False))


def edit_accel(path, **deepspeed):
    config = yaml.safe_load(path.read_text())
    config["deepspeed_config"].update(deepspeed)
    path.write_text(yaml.safe_dump(config))


def ds_json(project, name: str, accumulation, **zero):
    """Point a copy's Accelerate config at a DeepSpeed JSON holding the ZeRO settings (and `zero`) and the
    accumulation."""
    import json

    accel_path = project / "recipes" / "accelerate" / f"{name}.yaml"
    accel = yaml.safe_load(accel_path.read_text())
    ds = accel["deepspeed_config"]
    config = {
        "zero_optimization": {"stage": ds["zero_stage"], "stage3_gather_16bit_weights_on_model_save": True, **zero},
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": "auto",
    }
    (project / "recipes" / "accelerate" / f"{name}.json").write_text(json.dumps(config))
    accel["deepspeed_config"] = {
        "deepspeed_config_file": f"recipes/accelerate/{name}.json",
        "deepspeed_multinode_launcher": "standard",
        "zero3_init_flag": ds["zero_stage"] == 3,
    }
    accel.pop("mixed_precision", None)
    accel_path.write_text(yaml.safe_dump(accel))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Rehearse it all once; yields {(recipe, nodes, gpus): (outcomes, plans)} and what could not run."""
    project = tmp_path_factory.mktemp("rehearsal-project")
    import shutil

    shutil.copytree(ROOT / "recipes", project / "recipes")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        made = copies(project)
        jobs, skipped, envs = {}, [], {}
        for name in RECIPES + sorted(made):
            extra = [(made[name], 8)] if name in made else [DEFAULTS[name]] if name in DEFAULTS else []
            for nodes, gpus in TOPOLOGIES + extra:
                path = project / "recipes" / f"{name}.yaml"
                found = batch_for(path, nodes, gpus)
                suggested = re.findall(r"GLOBAL_BATCH_SIZE=(\d+)", found) if isinstance(found, str) else []
                if suggested:  # the recipe's batch does not fit this shape: the batch orch suggests instead
                    envs[(name, nodes, gpus)] = {"GLOBAL_BATCH_SIZE": max(suggested, key=int)}
                    found = batch_for(path, nodes, gpus, envs=envs[(name, nodes, gpus)])
                if isinstance(found, str):
                    skipped.append((name, nodes, gpus, found))
                else:
                    jobs[(name, nodes, gpus)] = found
        started = time.monotonic()
        results = driver.rehearse_batches([b for b, _ in jobs.values()], project, parallel=2)
        took = time.monotonic() - started
    finally:
        os.chdir(cwd)
    MATRIX_ENVS.update(envs)
    yield {key: (outcomes, jobs[key][1]) for key, outcomes in zip(jobs, results, strict=True)}, skipped, took, project


def test_every_recipe_at_every_shape_is_accepted_by_the_owners_code(matrix):
    results, skipped, took, _ = matrix
    failed = {key: [(o.role, o.stage, o.error) for o in outcomes if not o.ok] for key, (outcomes, _) in results.items()}
    assert not any(failed.values()), {k: v for k, v in failed.items() if v}
    for name in RECIPES:  # every recipe ran somewhere, and its default 2x8 shape everywhere it can
        assert any(key[0] == name for key in results), name
    # a shape is skipped only where it cannot run at all: a vLLM server node needs a second node, context or
    # sequence parallelism needs 2 GPUs; every other recipe meets every topology
    impossible = {("qwen25_grpo_vllm_server", 1, 1), ("qwen25_grpo_vllm_server", 1, 8)}
    impossible |= {(name, 1, 1) for name in ("qwen3_sft_alst", "qwen3_sft_fsdp_cp")}
    assert {(n, a, b) for n, a, b, _ in skipped} == impossible, skipped
    assert len(results) == len(RECIPES) * len(TOPOLOGIES) - len(impossible) + len(copies_made(results)) + len(DEFAULTS)
    assert all((name, *shape) in results for name, shape in DEFAULTS.items())  # each at its own default shape too
    assert ("llama3_70b_sft_fsdp", 4, 8) in results
    for (name, nodes, gpus), (outcomes, plans) in results.items():
        head = outcomes[0].facts
        trainers = [p for p in plans if p.role == "trainer"]
        assert head["world_size"] == trainers[0].topology.total_gpus, (name, nodes, gpus)
        assert head["gradient_accumulation_steps"] == (
            trainers[0].gradient_accumulation_steps or head["gradient_accumulation_steps"]
        )
        if len(outcomes) > 1 and outcomes[1].facts.get("rank") is not None:
            assert outcomes[1].facts["rank"] == gpus  # node 1's first process
    print(f"rehearsed {sum(len(o) for o, _ in results.values())} roles of {len(results)} launches in {took:.0f} s")


def copies_made(results) -> set:
    return {key for key in results if key[0] not in RECIPES}


def test_edited_copies_get_orchs_accumulation_everywhere(matrix):
    results, _, _, _ = matrix
    pinned, plans = results[("zero2_pinned", 2, 8)]
    assert pinned[0].facts["gradient_accumulation_steps"] == plans[0].gradient_accumulation_steps != 2
    json_ds, plans = results[("zero3_json", 2, 8)]
    assert json_ds[0].facts["zero_stage"] == 3
    assert json_ds[0].facts["gradient_accumulation_steps"] == plans[0].gradient_accumulation_steps


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_prints_the_rehearsal_and_reuses_it(matrix, recipe):
    """`orch run <recipe> --gpus H100:8 --nodes 2 --dry-run`: the matrix rehearsed this exact launch, so the dry
    run finds it in the cache."""
    _, _, _, project = matrix
    nodes = 16 if recipe == "llama3_70b_sft_fsdp" else 2  # 70B's states do not fit 16 GPUs (the memory check says)
    flags = [f"--env={k}={v}" for k, v in MATRIX_ENVS.get((recipe, nodes, 8), {}).items()]
    result = orch("run", recipe, "--gpus", "H100:8", "--nodes", str(nodes), "--dry-run", "--skip-optimizer",
                  "--secret", "HF_TOKEN=x", *flags, cwd=project, env=ON)  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "rehearsed" in x)
    assert re.search(
        rf"^\[orch\] rehearsed [23] role\(s\) of {nodes * 8} rank\(s\) with transformers 5\.17\.0, trl 1\.16\.0", line
    )
    assert line.endswith("(cached)")


@pytest.mark.parametrize("copy", ["zero3_json", "dpo_offload", "sft_profile"])
def test_a_dry_run_of_an_edited_copy_runs_the_strategy_it_plans(matrix, copy):
    """The edited copies through `orch run --dry-run` (the matrix rehearsed them: cached), where the rehearsed
    trainer's strategy is compared with the plan's (checks._not_as_planned): a DeepSpeed JSON holds the stage the
    Accelerate config leaves unsaid, and was taken for a mismatch before the comparison knew it."""
    _, _, _, project = matrix
    result = orch("run", copy, "--gpus", "H100:8", "--nodes", "2", "--dry-run", "--skip-optimizer",
                  "--secret", "HF_TOKEN=x", cwd=project, env=ON)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(cached)" in next(x for x in result.stdout.splitlines() if "rehearsed" in x)


# ---------------------------------------------------------------- the GPU-fixes findings, reintroduced in copies


def cp(project, source: str, name: str):
    assert orch("cp", source, name, cwd=project).returncode == 0


FINDINGS = dict(
    zip(
        ["packing-cp", "alst-dropped-key", "zero3-no-16bit", "ds-json-accumulation", "ds-json-dpo", "ds-clipping",
         "tracker-not-installed", "tracker-unknown", "optimizer-not-installed", "ds-json-unknown-key",
         "attention-unknown"],
        [
            (
                "qwen3_sft_fsdp_cp",
                lambda p, n: edit_env(p / "recipes" / f"{n}.yaml", TRL_OVERRIDES="packing=true"),
                "TRL's SFTTrainer refuses packing with context parallelism (cp_size=2)",
            ),
            (
                "qwen3_sft_alst",
                lambda p, n: edit_accel(
                    p / "recipes/accelerate" / f"{n}.yaml", seq_parallel_communication_data_type="bf16"
                ),
                "does not pass deepspeed_config.seq_parallel_communication_data_type",
            ),
            (
                "llama3_sft_zero3",
                lambda p, n: edit_accel(p / "recipes/accelerate" / f"{n}.yaml", zero3_save_16bit_model=False),
                "ZeRO-3 without 16-bit gathering on save",
            ),
            (
                "llama3_sft_zero3",
                lambda p, n: ds_json(p, n, 2),  # a DeepSpeed JSON whose own accumulation disagrees with the batch
                "(transformers' DeepSpeed config: ValueError: ",  # transformers compares it with TrainingArguments
            ),
            (
                "qwen25_dpo_zero2",
                lambda p, n: ds_json(p, n, 2),  # DPO's reference model meets DeepSpeed's own batch check first
                "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                "64 != 4 * 2 * 16",
            ),
            (
                "qwen25_dpo_zero2",
                lambda p, n: edit_accel(p / "recipes/accelerate" / f"{n}.yaml", gradient_clipping=0.5),
                "ds gradient_clipping=0.5 vs hf max_grad_norm=1.0",
            ),
            (
                # the Trainer's constructor makes report_to's callbacks after the model loads: wandb is not in uv.lock
                "qwen25_sft_ddp",
                lambda p, n: edit_env(p / "recipes" / f"{n}.yaml", TRL_OVERRIDES="report_to=wandb"),
                "(trackers (report_to): RuntimeError: WandbCallback requires wandb to be installed. Run `pip install "
                "wandb`.); the nodes install uv.lock's orch[train], which has no tracker",
            ),
            (
                "qwen25_sft_ddp",
                lambda p, n: edit_env(p / "recipes" / f"{n}.yaml", TRL_OVERRIDES="report_to=weights_and_biases"),
                "(trackers (report_to): ValueError: weights_and_biases is not supported, only azure_ml, ",
            ),
            (
                # train() looks the optimizer up first, after the model loaded: LOMO's package is not in uv.lock
                "qwen25_sft_ddp",
                lambda p, n: edit_env(p / "recipes" / f"{n}.yaml", TRL_OVERRIDES="optim=lomo"),
                "(optimizer (optim): ImportError: You need to install `lomo_optim` in order to use LOMO optimizers. ",
            ),
            (
                # deepspeed.initialize reads a DeepSpeed JSON in train(), after the model loaded (ZeRO-3's zero.Init
                # and DPO's reference model read it in the trainer's constructor): its pydantic models forbid the key
                "qwen3_sft_zero1",
                lambda p, n: ds_json(p, n, "auto", offload_optimzer={"device": "cpu"}),
                "(DeepSpeed's config: ValidationError: 1 validation error for DeepSpeedZeroConfig offload_optimzer "
                "Extra inputs are not permitted",
            ),
            (
                # the rehearsal loads SDPA in place of what the nodes load: transformers' own check of the name
                "qwen25_sft_ddp",
                lambda p, n: edit_env(p / "recipes" / f"{n}.yaml", TRL_OVERRIDES="attn_implementation=flash_attn_2"),
                '(attention (attn_implementation): ValueError: Specified `attn_implementation="flash_attn_2"` is not '
                "supported.",
            ),
        ],
        strict=True,
    )
)


@pytest.fixture(scope="module")
def findings(matrix):
    """The findings' copies, made in the matrix's project and rehearsed there in one process (the CLI's dry runs
    below then find their outcomes in the rehearsal cache, as a user's second dry run would)."""
    _, _, _, project = matrix
    cwd = os.getcwd()
    os.chdir(project)
    try:
        batches = []
        for label, (source, edit, _) in FINDINGS.items():
            name = f"finding_{label.replace('-', '_')}"
            cp(project, source, name)
            edit(project, name)
            found = batch_for(project / "recipes" / f"{name}.yaml", 2, 8)
            if not isinstance(found, str):  # a str: orch's own checks refuse it before any rehearsal
                batches.append(found[0])
        nvme = nvme_copies(project)
        outcomes = driver.rehearse_batches(batches + list(nvme.values()), project, parallel=2)
        NVME.update(zip(nvme, outcomes[len(batches):], strict=True))
    finally:
        os.chdir(cwd)
    return project


NVME: dict = {}  # the NVMe-offload copies' outcomes: laptop (accelerate's env, a DeepSpeed JSON) and head node


def nvme_copies(project) -> dict:
    """llama3_sft_zero3 with both offloads on NVMe (in the Accelerate config) and the optimizer's (in a DeepSpeed
    JSON), rehearsed as the laptop does, and the first as the head node does (driver.Batch.nvme)."""
    swap = project / "nvme"
    swap.mkdir(exist_ok=True)
    cp(project, "llama3_sft_zero3", "nvme_offload")
    edit_accel(project / "recipes/accelerate/nvme_offload.yaml", offload_param_device="nvme",
               offload_param_nvme_path=str(swap), offload_optimizer_device="nvme",
               offload_optimizer_nvme_path=str(swap))  # fmt: skip
    cp(project, "llama3_sft_zero3", "nvme_json")
    ds_json(project, "nvme_json", "auto", offload_optimizer={"device": "nvme", "nvme_path": str(swap)})
    laptop = {name: batch_for(project / "recipes" / f"{name}.yaml", 2, 8)[0] for name in ("nvme_offload", "nvme_json")}
    return {**laptop, "head": laptop["nvme_offload"]._replace(nvme=True)}


def test_nvme_offload_is_rehearsed_as_cpu_offload_on_the_laptop_and_as_it_is_on_the_head_node(findings):
    """This machine has no libaio, which DeepSpeed's async_io op (its NVMe swapper) builds against. The laptop's
    rehearsal refused such a launch with its own "Unable to JIT load the async_io op" (the nodes' libaio is theirs):
    it now rehearses NVMe as CPU offload, in accelerate's environment or a copy of the DeepSpeed JSON, and says so; the
    head node's builds async_io as the ranks will and stops the setup with DeepSpeed's words and the fix."""
    for name, swapped in (("nvme_offload", "optimizer and param"), ("nvme_json", "optimizer")):
        (outcome,) = NVME[name][:1]
        assert outcome.ok and outcome.facts["zero_stage"] == 3, outcome
        assert outcome.facts["nvme_offload"] == f"{swapped} offload to NVMe rehearsed as CPU offload (the head node " \
            "rehearses NVMe)"  # fmt: skip
    head = NVME["head"][0]
    assert not head.ok and head.stage == "trainer" and "Unable to JIT load the async_io op" in head.error, head
    assert "sudo apt-get install -y libaio-dev" in head.fix()
    result = orch("run", "nvme_offload", "--gpus", "H100:8", "--nodes", "2", "--dry-run", "--skip-optimizer",
                  "--secret", "HF_TOKEN=x", cwd=findings, env=ON)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(x for x in result.stdout.splitlines() if "rehearsed" in x)
    assert line.endswith("optimizer and param offload to NVMe rehearsed as CPU offload (the head node rehearses NVMe) "
                         "(cached)"), line  # fmt: skip
    assert "under ZeRO-3 with NVMe offload on 16 GPUs" in result.stdout and "host memory while training" not in \
        result.stdout and re.search(r"^NVMe while training: ~\d+\.\d GiB per node in " + re.escape(
            str(findings / "nvme")), result.stdout, re.M), result.stdout  # fmt: skip


@pytest.mark.parametrize("label", list(FINDINGS))
def test_findings_reintroduced_in_a_copy_are_refused_with_one_line(findings, label):
    project, message = findings, FINDINGS[label][2]
    name = f"finding_{label.replace('-', '_')}"
    result = orch("run", name, "--gpus", "H100:8", "--nodes", "2", "--dry-run", "--skip-optimizer",
                  "--secret", "HF_TOKEN=x", cwd=project, env=ON)  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: ") and message in line, line
    assert not (project / "sky_jobs").exists()


def test_a_refusal_names_role_owner_and_fix(findings):
    name = "finding_ds_json_accumulation"  # llama3_sft_zero3 with a DeepSpeed JSON pinning accumulation 2
    result = orch("run", name, "--gpus", "H100:8", "--nodes", "2", "--dry-run", "--skip-optimizer",
                  "--secret", "HF_TOKEN=x", cwd=findings, env=ON)  # fmt: skip
    line = result.stderr.strip()
    assert line.startswith(f"orch: error: rehearsal of {name}: the head (node 0) would fail on its GPUs "
                           "(transformers' DeepSpeed config: ValueError: ")  # fmt: skip
    assert line.endswith('set gradient_accumulation_steps to "auto" in the DeepSpeed config (orch gives accelerate '
                         "and TRL the value GLOBAL_BATCH_SIZE needs)")  # fmt: skip


def test_the_launchs_gpu_and_the_nodes_packages_are_what_the_owners_checks_see(project):
    """tf32=true: transformers asks the GPU's compute capability (>= 8.0), which the CPU build of torch has none of, so
    the rehearsal refused it for an A100 as for a T4; it now reports the launch's accelerator's (core/accelerators
    CUDA_CAPABILITY, as `orch run` passes it). Both in one rehearsal process."""
    from orchestrator.core.accelerators import CUDA_CAPABILITY

    path = ROOT / "recipes" / "qwen25_kto_ddp.yaml"
    batch, _ = batch_for(path, 1, 4, trl_overrides={"tf32": "true"}, envs={"GLOBAL_BATCH_SIZE": "64"})
    ampere, turing = (batch._replace(capability=CUDA_CAPABILITY[name]) for name in ("A100", "T4"))
    # and a head node's own packages: Liger (orch's gpu extra) is not installed here, which a laptop's rehearsal swaps
    # off and a node's refuses, as the ranks' first step would (transformers' apply_liger_kernel)
    sft, plans = batch_for(ROOT / "recipes" / "qwen25_sft_ddp.yaml", 1, 4, envs={"GLOBAL_BATCH_SIZE": "64"})
    node = sft._replace(substitute=driver.substitutions("sft", plans[0].settings, Path(sft.smoke[2]),
                                                        driver.output_dir(), node=True))  # fmt: skip
    # precompute_ref_log_probs is swapped off (it runs the reference model on the GPU in the trainer's constructor),
    # but not where that constructor refuses it first: with sync_ref_model
    synced, _ = batch_for(path, 1, 4, trl_overrides={"precompute_ref_log_probs": "true", "sync_ref_model": "true"},
                          envs={"GLOBAL_BATCH_SIZE": "64"})  # fmt: skip
    # a schedule without its arguments: train() makes it after the model loaded (transformers' get_scheduler)
    minimum, _ = batch_for(path, 1, 4, trl_overrides={"lr_scheduler_type": "cosine_with_min_lr"},
                           envs={"GLOBAL_BATCH_SIZE": "64"})  # fmt: skip
    # a streamed dataset (dataset_streaming, which the training entry passes to datasets as TRL's scripts do) has no
    # length: the trainer's constructor asks for max_steps
    streamed, _ = batch_for(path, 1, 4, trl_overrides={"dataset_streaming": "true", "max_steps": "-1"},
                            envs={"GLOBAL_BATCH_SIZE": "64"})  # fmt: skip
    # fp16 under DeepSpeed (a V100's or T4's mixed precision): its engine asks its accelerator, here its CPU one,
    # which refused fp16 for every GPU ("Type fp16 is not supported on your device"); now its CUDA accelerator's code
    # answers for the launch's GPU, which refuses fp16 below compute capability 7.0 as on a node
    half, _ = batch_for(ROOT / "recipes" / "qwen25_dpo_zero2.yaml", 1, 8, trl_overrides={"fp16": "true",
                                                                                     "bf16": "false"})  # fmt: skip
    halves = [half._replace(capability=c) for c in (CUDA_CAPABILITY["T4"], (6, 0))]
    # fp16 under DDP on a model loaded in fp16: torch's GradScaler refuses its gradients at the first step
    whole, _ = batch_for(ROOT / "recipes" / "qwen25_sft_ddp.yaml", 1, 4, trl_overrides={
        "dtype": "float16", "fp16": "true", "bf16": "false"}, envs={"GLOBAL_BATCH_SIZE": "64"})  # fmt: skip
    (a100,), (t4,), (liger,), (sync,), (scheduled,), (stream,), (fp16,), (pascal,), (scaled,) = driver.rehearse_batches(
        [ampere, turing, node, synced, minimum, streamed, *halves, whole], project, parallel=2
    )
    assert not scaled.ok and (scaled.stage, scaled.error) == ("gradient scaler (fp16)", "ValueError: Attempting to "
                                                              "unscale FP16 gradients.")  # fmt: skip
    assert scaled.fix().startswith("fp16=true scales fp32 weights' gradients: load the model in fp32 (dtype=float32")
    assert fp16.ok, (fp16.stage, fp16.error)
    assert not pascal.ok and (pascal.stage, pascal.error) == ("trainer", "ValueError: Type fp16 is not supported on "
                                                              "your device.")  # fmt: skip
    assert not stream.ok and (stream.stage, stream.error.split(";")[0]) == (
        "trainer", "ValueError: The train_dataset does not implement __len__, so the number of training steps cannot "
        "be inferred")  # fmt: skip
    assert not scheduled.ok and (scheduled.stage, scheduled.error) == (
        "scheduler (lr_scheduler_type)",
        "ValueError: One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`",
    )
    assert scheduled.fix().startswith("set lr_scheduler_kwargs='{\"min_lr_rate\": 0.1}'")
    assert not sync.ok and (sync.stage, sync.error.split(". ")[0]) == (
        "trainer", "ValueError: You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`")
    assert not liger.ok and (liger.stage, liger.error) == ("Liger kernels", "ImportError: You have set "
        "`use_liger_kernel` to `True` but liger-kernel >= 0.3.0 is not available. Please install it with `pip install "
        "liger-kernel`")  # fmt: skip
    assert liger.fix() == "the nodes get Liger with orch's gpu extra (the recipe's setup: bash scripts/node-setup.sh " \
        "train,gpu), or set use_liger_kernel=false"  # fmt: skip
    assert a100.ok, (a100.stage, a100.error)
    assert not t4.ok and (t4.stage, t4.error) == (
        "TRL's parser", "ValueError: --tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7"
    )
    assert t4.fix() == "TF32 needs compute capability 8.0 or more (A100, A10G, L4, L40S, H100; not T4 or V100): set " \
        "tf32=false"  # fmt: skip
    # and `orch run --gpus T4:4` hands the rehearsal that capability
    from orchestrator.launch import checks

    handed = []

    def capture(batches, *args, **kwargs):
        handed.extend(batches)
        raise Rehearsed

    launch = resolve(recipes.load(str(path)), nodes=1, gpus=Gpus("T4", 4), envs={"GLOBAL_BATCH_SIZE": "64"})
    original, driver.rehearse_batches = driver.rehearse_batches, capture
    try:
        with pytest.raises(Rehearsed):
            checks.rehearse(launch, checks.Checked(previews(launch), None))
    finally:
        driver.rehearse_batches = original
    assert [b.capability for b in handed] == [(7, 5)]


def test_an_edit_to_a_config_is_rehearsed_again(project):
    command = ["run", "qwen25_kto_ddp", "--gpus", "L4:2", "--dry-run", "--skip-optimizer"]
    first = orch(*command, cwd=project, env=ON)  # 1 x L4:2: a shape the matrix does not rehearse
    again = orch(*command, cwd=project, env=ON)
    assert first.returncode == 0 and "rehearsed 1 role(s) of 2 rank(s)" in first.stdout, first.stderr
    assert "(cached)" not in first.stdout and again.stdout.count("(cached)") == 1
    # a DDP recipe loading its model in bf16: the plan says, before launch, what its first step will read back
    assert "\nprecision: the optimizer will update bf16 weights (DDP over a model loaded in bf16" in first.stdout
    config = project / "recipes" / "trl" / "qwen25_kto.yaml"
    config.write_text(config.read_text().replace("beta: 0.1", "beta: 0.2"))
    edited = orch(*command, cwd=project, env=ON)
    assert edited.returncode == 0 and "(cached)" not in edited.stdout


# ---------------------------------------------------------------- on the head node, in its setup


SETUP_ENV = {
    "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2\n",
    "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "8",
    "TRL_TRAINER": "sft",
    "TRL_CONFIG": "recipes/trl/qwen3_sft_zero1.yaml",
    "ACCELERATE_CONFIG": "zero1",
    "GLOBAL_BATCH_SIZE": "128",
    "CHECKPOINT_ROOT": "/checkpoints",
    "ORCH_DISK_CHECK": "off",  # this machine's disk is not the head node's these tests stand for (test_disk_room.py)
    **ON,
}


def test_node_rehearses_in_setup_on_the_head_only():
    """(Liger off: the head node rehearses in its own environment, which here has no Liger; the refusal is
    test_the_launchs_gpu_and_the_nodes_packages_are_what_the_owners_checks_see.)"""
    env = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "TRL_OVERRIDES": "use_liger_kernel=false"}
    head = orch("node", "--rehearse", env=env)
    assert head.returncode == 0, head.stderr
    assert re.search(
        r"^\[orch\] rehearsed 2 role\(s\) of 16 rank\(s\) .*: DEEPSPEED, ZeRO-1, accumulation 2", head.stdout, re.M
    )
    other = orch("node", "--rehearse", env={**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "1"})
    assert other.returncode == 0 and "node 1 leaves it to the head node" in other.stdout


@pytest.mark.unit
def test_the_head_node_rehearses_without_bitsandbytes_unless_the_launch_uses_it(handed):
    """As on nodes without the quant extra (core/bnb.py); a bitsandbytes optimizer or 4/8-bit loading keeps it."""
    from orchestrator.node import exec as node_exec

    base = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "ORCH_RUN_ID": "run-a"}
    for words in ("", "optim=paged_adamw_8bit", "load_in_8bit=true"):
        with pytest.raises(Rehearsed):
            node_exec.rehearse({**base, "TRL_OVERRIDES": words})
    assert [b.bitsandbytes for b in handed] == [False, True, True]


@pytest.mark.unit
def test_a_relaunch_or_a_new_cluster_on_the_same_home_finds_the_head_nodes_rehearsal_cached(handed):
    """The cache key leaves out what cannot change a rehearsal's outcome: the run's output_dir (new at every relaunch:
    a new run id; the rehearsal's own output_dir, appended later, overrides it) and the rendezvous address (a new
    cluster over the same shared home has new IPs). What the owners' code reads still keys it."""
    from orchestrator.node import exec as node_exec

    base = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "ORCH_RUN_ID": "run-a"}

    def key(**changes: str) -> str:
        handed.clear()
        with pytest.raises(Rehearsed):
            node_exec.rehearse({**base, **changes})
        (batch,) = handed
        (head, *_) = batch.roles
        if "ORCH_RUN_ID" in changes:  # the role's own argv did change: only the key leaves it out
            assert f"/checkpoints/{changes['ORCH_RUN_ID']}" in head.argv
        assert batch.substitute[batch.substitute.index("--output_dir") + 1] == driver.output_dir()
        return driver.cache_key(batch, ROOT)

    first = key()
    assert key(ORCH_RUN_ID="run-b") == first  # `orch run --resume`, a rerun: a new output_dir
    assert key(SKYPILOT_SETUP_NODE_IPS="10.9.0.7\n10.9.0.8\n", CHECKPOINT_ROOT="/mnt/ckpt") == first
    assert key(MAIN_PROCESS_PORT="29611") != first
    assert key(GLOBAL_BATCH_SIZE="256") != first
    assert key(SKYPILOT_SETUP_NODE_IPS="10.0.0.1\n10.0.0.2\n10.0.0.3\n10.0.0.4\n") != first  # 4 nodes


@pytest.mark.unit
def test_the_head_nodes_rehearsal_reports_its_own_gpus_compute_capability(handed, monkeypatch, tmp_path):
    """A plain `sky launch --gpus T4:8` never met the launch side's accelerator table: the head node hands the rehearsal
    what nvidia-smi says of its GPUs (the lowest compute_cap), so tf32=true is refused there as `orch run` refuses it
    (the owners' refusal itself: test_the_launchs_gpu_and_the_nodes_packages_are_what_the_owners_checks_see)."""
    from orchestrator.node import exec as node_exec

    tool = tmp_path / "nvidia-smi"
    tool.write_text('#!/bin/sh\n[ "$*" = "--query-gpu=compute_cap --format=csv,noheader" ] || exit 9\n'
                    "printf '8.9\\n7.5\\n'\n")  # fmt: skip
    tool.chmod(0o755)
    env = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "ORCH_MEMORY_CHECK": "off"}
    # the recipe trains in bf16, which a 7.5 GPU would emulate: refused before the rehearsal (core/precision.py), as
    # `orch run --gpus T4:8` refuses it; with the fix it names, the rehearsal gets the capability
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(OrchError) as refused:
        node_exec.rehearse({**env, "TRL_OVERRIDES": "learning_rate=2e-05"})
    assert str(refused.value).startswith("this node's GPU (compute capability 7.5) has no bf16 tensor cores")
    assert "; set bf16=false fp16=true dtype=float32 (`orch run RECIPE bf16=false fp16=true dtype=float32`, or `sky " \
        "launch ... --env TRL_OVERRIDES='learning_rate=2e-05 bf16=false fp16=true dtype=float32'`) (fp16" in \
        str(refused.value)  # fmt: skip  # the node's own overrides kept, in both launchers' words
    assert handed == []
    env["TRL_OVERRIDES"] = "bf16=false fp16=true dtype=float32"
    for path, capability in ((f"{tmp_path}:/usr/bin:/bin", (7, 5)), ("/usr/bin:/bin", None)):
        monkeypatch.setenv("PATH", path)
        handed.clear()
        with pytest.raises(Rehearsed):
            node_exec.rehearse(env)
        assert [b.capability for b in handed] == [capability]


def test_node_rehearsal_stops_the_setup_with_one_line(project):
    cp(project, "qwen25_dpo_zero2", "bad_json")
    ds_json(project, "bad_json", 3)
    env = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "TRL_TRAINER": "dpo", "GLOBAL_BATCH_SIZE": "64"}
    env.update(TRL_CONFIG="recipes/trl/bad_json.yaml", ACCELERATE_CONFIG="recipes/accelerate/bad_json.yaml")
    result = orch("node", "--rehearse", env=env, cwd=project)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "the head (node 0) would fail on its GPUs (trainer: AssertionError: Check batch related" in line
    assert line.endswith('set gradient_accumulation_steps to "auto" in the DeepSpeed config (orch gives accelerate '
                         "and TRL the value GLOBAL_BATCH_SIZE needs)")  # fmt: skip


def test_plain_sky_launch_gets_the_values_trl_checks_only_as_it_trains_refused_in_the_heads_setup(project):
    """`orch run` refuses them on the laptop; plain `sky launch` brings them to the head's setup, which checks them
    after its rehearsal (TRL's parser has taken them), before the model has loaded: GRPO's first step refused
    `scale_rewards=false` (the command line keeps the text) after the first generation."""
    env = {**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0", "TRL_TRAINER": "grpo", "GLOBAL_BATCH_SIZE": "256",
           "TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu", "ORCH_REHEARSAL": "off",
           "ORCH_MEMORY_CHECK": "off", "TRL_OVERRIDES": "scale_rewards=false"}  # fmt: skip
    result = orch("node", "--rehearse", env=env, cwd=project)
    assert result.returncode == 2, result.stdout[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: TRL_OVERRIDES scale_rewards=false: on the command line TRL keeps false as "
                           "text"), line  # fmt: skip


def test_node_rehearsal_quotes_the_parsers_refusal_not_its_exit(project):
    """A TRL config value of the wrong type reaches a node only through plain `sky launch` (`orch run` refuses it on the
    laptop with its own schema): TRL's parser prints what it refuses and exits 2; the line quotes that, not
    `SystemExit: 2`."""
    config = project / "recipes" / "trl" / "qwen3_sft_zero1.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["max_length"] = "long"
    config.write_text(yaml.safe_dump(settings))
    result = orch("node", "--rehearse", env={**SETUP_ENV, "SKYPILOT_SETUP_NODE_RANK": "0"}, cwd=project)
    assert result.returncode == 2, result.stdout[-2000:]
    (line,) = result.stderr.strip().splitlines()
    refused = "argument --max_length/--max-length: invalid int value: 'long'"
    assert line.endswith(f"(TRL's parser: ValueError: {refused})"), line


@pytest.mark.unit
def test_a_setting_whose_package_the_nodes_extras_lack_is_refused_before_launch():
    """This machine's rehearsal finds Trackio and bitsandbytes (the dev extra) and swaps Liger and vLLM off (GPU-only
    packages): none of that says what the nodes install, which is uv.lock's orch[EXTRAS] as the recipe's setup names
    them (`orch run --track` adds track)."""
    import dataclasses

    from orchestrator.launch import checks

    phi3 = recipes.load(str(ROOT / "recipes" / "phi3_dpo_fsdp.yaml"))  # bash scripts/node-setup.sh train
    for key, value, message in [
        ("report_to", "trackio", "report_to=trackio: the nodes get Trackio with orch's track extra, which the recipe's "
                                 "setup does not install (train); add --track, which installs it"),
        ("use_liger_kernel", "true", "use_liger_kernel=true: the nodes get Liger's kernels with orch's gpu extra, "
                                     "which the recipe's setup does not install (train); add gpu to the recipe's "
                                     "setup: bash scripts/node-setup.sh train,gpu, or drop use_liger_kernel=true"),
        ("load_in_4bit", "yes", "load_in_4bit=yes: the nodes get bitsandbytes with orch's quant extra"),  # as given
        ("optim", "paged_adamw_8bit", "optim=paged_adamw_8bit: the nodes get bitsandbytes with orch's quant extra"),
        # a Hub kernel, or flash attention's Hub fallback (uv.lock has no flash-attn), loads with the kernels package
        ("attn_implementation", "flash_attention_2", "attn_implementation=flash_attention_2: the nodes get the "
                                                     "Kernels Hub's loader (kernels) with orch's gpu extra"),
        ("model_init_kwargs", '{"attn_implementation": "kernels-community/flash-attn2"}',
         "attn_implementation=kernels-community/flash-attn2: the nodes get the Kernels Hub's loader"),
    ]:
        with pytest.raises(OrchError) as refused:
            checks.check_extras(resolve(phi3, trl_overrides={key: value}))
        assert str(refused.value).startswith(message), str(refused.value)
    listed = dataclasses.replace(phi3, envs={**phi3.envs, "TRL_OVERRIDES": "report_to='none trackio'"})
    with pytest.raises(OrchError, match=r"^report_to=trackio: "):
        checks.check_extras(resolve(listed))
    checks.check_extras(resolve(phi3, trl_overrides={"report_to": "trackio"}, envs={"ORCH_TRACK": "curves"}))
    setup = phi3.task["setup"].replace("node-setup.sh train", "node-setup.sh train,gpu,track")
    named = dataclasses.replace(phi3, task={**phi3.task, "setup": setup})
    checks.check_extras(resolve(named, trl_overrides={"report_to": "trackio", "use_liger_kernel": "true"}))
    own_image = dataclasses.replace(phi3, task={**phi3.task, "setup": "pip install my-stack"})  # not ours to say
    checks.check_extras(resolve(own_image, trl_overrides={"use_liger_kernel": "true"}))
    grpo = recipes.load(str(ROOT / "recipes" / "qwen25_grpo_ddp.yaml"))  # train,gpu,vllm
    without = dataclasses.replace(grpo, task={**grpo.task, "setup": "bash scripts/node-setup.sh train,gpu"})
    with pytest.raises(OrchError, match=r"^use_vllm=true: the nodes get vLLM with orch's vllm extra, "):
        checks.check_extras(resolve(without))
    for name in RECIPES:  # every recipe's setup installs what its settings need
        checks.check_extras(resolve(recipes.load(str(ROOT / "recipes" / f"{name}.yaml"))))
    from transformers.trainer_optimizer import _BITSANDBYTES_OPTIMIZERS  # the installed transformers' own list

    assert checks.BNB_OPTIMIZERS == [str(name.value) for name in _BITSANDBYTES_OPTIMIZERS]


@pytest.mark.unit
def test_a_node_swaps_off_only_what_it_has_installed(tmp_path):
    """vLLM's engine cannot start in a rehearsal, so use_vllm is swapped off where vLLM is installed; on a node without
    it, TRL's trainer refuses first (`vLLM is not available and use_vllm is set to True`), and the fix names the
    extra. A laptop swaps Liger and vLLM off whatever it has: the nodes' extras are check_extras' to judge."""
    settings = {"use_vllm": True, "use_liger_kernel": True}
    laptop = driver.substitutions("grpo", settings, tmp_path, "out")
    node = driver.substitutions("grpo", settings, tmp_path, "out", node=True)
    assert driver.importable("vllm") is False and driver.importable("liger_kernel") is False  # this machine
    assert laptop[-4:] == ["--use_liger_kernel", "false", "--use_vllm", "false"]
    # the smoke data has one split: an eval_strategy evaluates on it (TRL's default test split would be a KeyError)
    assert laptop[laptop.index("--dataset_test_split") + 1] == "train"
    # TRL 1.16's DPO and KTO trainers precompute the reference log-probs in their constructor, on the GPU: swapped off
    precomputed = driver.substitutions("dpo", {"precompute_ref_log_probs": True}, tmp_path, "out", node=True)
    assert precomputed[-2:] == ["--precompute_ref_log_probs", "false"]
    assert "--use_vllm" not in node and "--use_liger_kernel" not in node
    refused = driver.Outcome("head (node 0)", False, {}, "trainer", "ImportError: vLLM is not available and `use_vllm` "
                             "is set to True. Please install vLLM with `pip install trl[vllm]` to use it.")  # fmt: skip
    assert refused.fix().startswith("the nodes get vLLM with orch's vllm extra (the recipe's setup: bash ")


@pytest.mark.unit
def test_every_optimizer_package_transformers_asks_for_gets_the_lock_fix():
    """Each message transformers' optimizer lookup raises for a package uv.lock lacks (read from its source, so a new
    optimizer or a reworded message is met here) gets the fix that names the train extra; two of them are a
    ValueError saying `Please install` (grokadamw, adamw_anyprecision)."""
    import importlib.util
    from pathlib import Path

    # read, not imported (importing transformers' trainer takes seconds): the file the installed transformers runs
    source = (Path(importlib.util.find_spec("transformers").origin).parent / "trainer_optimizer.py").read_text()
    pattern = r'raise (ValueError|ImportError)\(\s*"((?:You need to (?:install|have)|Please install)[^"]*)"'
    asked = re.findall(pattern, source)
    assert len(asked) >= 8 and ("ValueError", "Please install grokadamw with `pip install grokadamw`") in asked
    for kind, message in asked:
        outcome = driver.Outcome("head (node 0)", False, {}, "optimizer (optim)", f"{kind}: {message}")
        assert outcome.fix(), message
        if "bitsandbytes" not in message:
            assert "put the package in pyproject.toml's train extra" in outcome.fix(), message


@pytest.mark.unit
def test_an_fp8_launch_without_an_fp8_backend_names_the_lock_fix():
    """`accelerate launch` refuses mixed_precision: fp8 where no FP8 backend is installed, on the laptop and on the
    nodes alike (uv.lock has none): the fix names the extra, not 'this machine'."""
    lock = (ROOT / "uv.lock").read_text()
    assert not any(f'name = "{p}"' in lock for p in ("torchao", "transformer-engine", "msamp"))
    refused = driver.Outcome("head (node 0)", False, {}, "accelerate launch", "RuntimeError: FP8 is not available on "
                             "this machine. Please ensure that either Transformer Engine, MSAMP or torchao is "
                             "installed.")  # fmt: skip
    assert refused.fix().startswith("the nodes install uv.lock's orch[train] and the recipe's extras, which have no "
                                    "FP8 backend (torchao, Transformer Engine, MS-AMP)")  # fmt: skip


@pytest.mark.unit
def test_the_attention_checked_is_the_one_trls_parser_would_take(tmp_path):
    """The last --attn_implementation wins over the --config file's, which wins over transformers' default (SDPA)."""
    from orchestrator.rehearsal import probes

    config = tmp_path / "trl.yaml"
    config.write_text("attn_implementation: flash_attention_2\n")
    assert probes.requested_attention(["sft", "--config", str(config)]) == "flash_attention_2"
    assert probes.requested_attention(["sft", "--config", str(config), "--attn_implementation", "eager",
                                       "--attn_implementation", "flex_attention"]) == "flex_attention"  # fmt: skip
    config.write_text("beta: 0.1\n")
    assert probes.requested_attention(["sft", "--config", str(config)]) == "sdpa"


def test_without_the_training_stack_the_laptop_says_so(monkeypatch):
    from orchestrator.launch import checks

    monkeypatch.setattr(driver, "stack_installed", lambda: False)
    launch = resolve(recipes.load(str(ROOT / "recipes" / "phi3_dpo_fsdp.yaml")))
    line = checks.rehearse(launch, checks.check(launch))
    assert line.startswith("rehearsal: not here (the training stack is not installed")
    assert "the head node rehearses in its setup, while the model downloads" in line


def test_a_ten_thousand_node_dry_run_reuses_the_cached_rehearsal_and_summarises_the_ranks():
    """The same launch rehearsed once is not rehearsed again, and ranks beyond the first two are one line (how long it
    takes is `make bench`'s: orch run --nodes 10000 --dry-run)."""
    command = ["run", "llama3_sft_fsdp", "--gpus", "H100:8", "--nodes", "10000", "--env", "GLOBAL_BATCH_SIZE=160000",
               "--secret", "HF_TOKEN=x", "--dry-run", "--skip-optimizer"]  # fmt: skip
    first = orch(*command, env=ON)
    assert first.returncode == 0, first.stderr
    again = orch(*command, env=ON)
    assert again.returncode == 0
    assert "rehearsed 2 role(s) of 80000 rank(s)" in again.stdout and "(cached)" in again.stdout
    assert "ranks 2..9998: as rank 1, with --machine_rank 2..9998" in again.stdout
    as_asked = orch("run", "llama3_sft_fsdp", "--gpus", "H100:8", "--nodes", "10000", "--secret", "HF_TOKEN=x",
                    "--dry-run", "--skip-optimizer", env=ON)  # fmt: skip
    assert as_asked.returncode == 2 and "GLOBAL_BATCH_SIZE=128 is not a multiple" in as_asked.stderr


def test_the_rehearsal_calls_each_reward_function_in_the_nodes_environment(tmp_path):
    """GRPO's recipe scores with TRL's accuracy_reward, which needs math_verify only when called (at the first reward,
    on paid GPUs): with that package missing from the environment, as it was from uv.lock, the rehearsal stops the
    launch, quoting TRL; with it, the line names the functions it called."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["math_verify"] = None  # not installed\n')
    argv = ["run", "qwen25_grpo_ddp", "--nodes", "2", "--gpus", "none", "--smoke", "--dry-run"]
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    missing = orch(*argv, env={**ON, "PYTHONPATH": pythonpath, "ORCH_CACHE_DIR": str(tmp_path / "cache")})
    assert missing.returncode == 2, missing.stdout[-2000:] + missing.stderr[-2000:]
    assert re.fullmatch(r"orch: error: rehearsal of qwen25_grpo_ddp: the head \(node 0\) would fail on its GPUs "
                        r"\(reward functions: ImportError: Please install the `math_verify` package to use "
                        r"accuracy_reward\).*",
                        missing.stderr.strip()), missing.stderr  # fmt: skip
    # with the package, and the rows streamed (dataset_streaming: the first row is the iterator's, there is no row 0)
    found = orch(*argv, "dataset_streaming=true", env=ON)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "reward functions called: accuracy_reward, final model" in found.stdout
    assert "\nmemory: not estimated (CPU nodes: the estimate is of GPU memory)\n" in found.stdout  # not "no shape"


def test_a_rehearsal_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    """torch's launcher makes a torchelastic_* log directory in the temporary directory whenever it is given none, and
    never removes it: every rehearsed role left one (on the laptop at every uncached `orch run`, on the head node at
    every setup). Rehearsed here for real (a cache of its own), the rehearsal's process in a TMPDIR of its own."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(driver, "_cache_dir", lambda: tmp_path / "rehearsals")
    batch, _ = batch_for(ROOT / "recipes" / "qwen25_sft_ddp.yaml", 2, 2)
    (outcomes,) = driver.rehearse_batches([batch], ROOT)
    assert [o.ok for o in outcomes] == [True] * len(outcomes) and not outcomes[0].facts["cached"]
    left = sorted(p.name for p in temporary.iterdir())
    assert [name for name in left if not name.startswith("torchinductor_")] == [], left  # torch.compile's, shared


@pytest.mark.e2e
def test_a_data_file_is_rehearsed_with_its_own_rows_and_the_reward_functions_read_them(project):
    """With --data the rehearsal builds the trainer on the file's first rows (TRL prepares them as on the nodes) and
    calls the reward functions on its first row: GRPO's accuracy_reward reads `solution`, which rows of prompts alone
    lack; that stopped the first step on the nodes (`TypeError: accuracy_reward() missing 1 required positional
    argument: 'solution'`), after provisioning, since the rehearsal read the smoke data."""
    import json

    ask = {"prompt": [{"role": "user", "content": "What is 2 plus 2?"}]}
    (project / "asked.jsonl").write_text(json.dumps(ask) + "\n")
    (project / "solved.jsonl").write_text(json.dumps({**ask, "solution": "$4$"}) + "\n")
    argv = ["run", "qwen25_grpo_ddp", "--gpus", "A100:8", "--dry-run", "--skip-optimizer", "--data"]
    refused = orch(*argv, "asked.jsonl", cwd=project, env={**ON, "ORCH_DATA_CHECK": "off"})
    assert refused.returncode == 2, refused.stdout[-2000:]
    assert refused.stderr.strip() == (
        "orch: error: rehearsal of qwen25_grpo_ddp: the head (node 0) would fail on its GPUs (reward functions: "
        "TypeError: accuracy_reward() missing 1 required positional argument: 'solution'); a reward function reads a "
        "column the rows lack: give it in every row (accuracy_reward reads `solution`)"
    )
    taken = orch(*argv, "solved.jsonl", cwd=project, env={**ON, "ORCH_DATA_CHECK": "off"})
    assert taken.returncode == 0, taken.stderr
    assert re.search(r"reward functions called: accuracy_reward, .*swapped here: tiny qwen2 model, the --data file's "
                     r"first rows", taken.stdout), taken.stdout[-2000:]  # fmt: skip
