"""Node side: SkyPilot's environment -> the exact `accelerate launch` argv for the recipe's TRL trainer.

`plan()` is pure (an env mapping and the parsed configs in, a NodePlan out): the node environment is read once
(`RecipeEnv`), then `launcher.flags` (accelerate's part), `script.arguments` (the TRL script's part) and
`rules` (per trainer and strategy) build it; `node.exec` reads the files, passes orch's barrier, then prints
or execs. Nothing heavy is imported here: the node must start training with no delay of its own, and the
launch side computes every rank's plan with this same code before anything is sent.

Variables read (all set by SkyPilot or by the recipe's `envs:`):
  SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE  (SkyPilot)
  TRL_TRAINER        the TRL trainer: a name in core/trainers.py (`orch ls --trainers`)
  TRL_CONFIG         path of the TRL config (YAML of the trainer's arguments)
  ACCELERATE_CONFIG  path of the Accelerate config, or a TRL profile name (zero1..3, fsdp1, fsdp2, multi_gpu)
  GLOBAL_BATCH_SIZE  optional: samples per optimizer step over all ranks; sets gradient_accumulation_steps
  TRL_OVERRIDES      optional: `key=value` words appended to the TRL script's arguments
  MAIN_PROCESS_PORT  optional: rendezvous port on the head node (default 29500; SkyPilot's Ray uses 6380)
  VLLM_SERVER_NODES  optional: 1 makes the last node run `trl vllm-serve` (GRPO); the others train
  VLLM_SERVER_PORT   optional: that server's port (default 8000)
  CHECKPOINT_ROOT    optional: output_dir becomes CHECKPOINT_ROOT/<run id> (a bucket mount on a cloud). The run id
                     is ORCH_RUN_ID (orch run sets the run's name: stable across `orch run --resume` and managed-job
                     recoveries, so the relaunch resumes), else SKYPILOT_TASK_ID, else slurm-<job id>
  DDP_TIMEOUT        optional: seconds a collective may wait before the process group fails (TRL's ddp_timeout)
  OMP_NUM_THREADS    optional: CPU threads per process; orch sets cores / processes per node when the recipe
                     offloads to CPU (DeepSpeed's CPU Adam, FSDP offload), where torchrun would set 1
  ORCH_RENDEZVOUS_TIMEOUT, ORCH_BARRIER_PORT  optional: orch's pre-launch barrier (default 600 s beyond as long as
                     this node's setup took; port + 1)
  ORCH_DEVICE        optional: `cpu` makes every process a CPU process (the local backend sets it)
  ORCH_WATCHDOG, ORCH_STALL_FLOOR, ORCH_STALL_FIRST, ORCH_STALL_BUSY  optional: the progress watchdog
                     (node/watchdog.py); ORCH_NETCHECK, ORCH_MIN_BUS_GBPS: the network check (train/netcheck.py)
  ORCH_SHOW_NOTICES  optional: on shows the third-party notices the node otherwise hides (node/output.py)
  ORCH_MEMORY_CHECK  optional: off shows the head node's memory figures (node/memory.py) without refusing
  ORCH_PRECISION_CHECK  optional: off runs bf16 (or fp8) on GPUs without tensor cores for it (core/precision.py)
  ORCH_CUDA_ARCH_CHECK  optional: off runs on a GPU torch's build has no kernels for (core/cuda_arch.py,
                     train/devices.py)
  ORCH_RESUME_CHANGED  optional: on resumes a checkpoint trained with other settings (train/run_config.py names
                     them; without it every rank stops before step 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import accelerate_schema, batch, configs, overrides, parallel, strategy
from orchestrator.core import trainers as trainer_specs
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import check_knobs, env_port, knob
from orchestrator.core.topology import Topology
from orchestrator.core.trl_schema import check_trainer
from orchestrator.node import launcher, rules, script, vllm
from orchestrator.node.env import from_env

DEFAULT_PORT = 29500


class NodePlan(NamedTuple):
    """What one node will run."""

    argv: list[str]
    """The full command (`accelerate launch ...`, or `trl vllm-serve ...`), as an argv list (never a shell string)."""
    topology: Topology
    """The training job as this node sees it (the vLLM server node, if any, is not part of it)."""
    cluster: Topology
    """Every node of the cluster (what orch's barrier waits for)."""
    runs_as: str
    """What will really run: the config's type on GPUs, `DDP over gloo` on CPU, `vLLM server`."""
    gradient_accumulation_steps: int | None = None
    per_device_batch: int | None = None
    data_parallel_size: int | None = None
    """Ranks that see different samples: total processes / (cp x sp x tp)."""
    role: str = "trainer"
    """`trainer`, or `vllm-server` for the node that runs TRL's vLLM server."""
    notes: tuple[str, ...] = ()
    env: dict[str, str] = {}
    """Variables the node sets before it execs the argv (never secrets: those are in the node's own env)."""
    trainer: str = ""
    """The recipe's TRL trainer, as checked."""
    settings: Mapping[str, object] = {}
    """The TRL settings the script will see (the config file's, then TRL_OVERRIDES), as plan() read them."""
    sizes: parallel.Sizes | None = None
    """The parallelism config refit to the training processes (None without one, or where the CPU falls back)."""


class RecipeEnv(NamedTuple):
    """The recipe's variables, read once from the node's env."""

    trainer: str
    trl_path: str
    accel_path: str
    port: str
    device: str
    overrides: dict[str, str]
    global_batch: int | None


def read_recipe_env(env: Mapping[str, str]) -> RecipeEnv:
    trainer = check_trainer(configs.required(env, "TRL_TRAINER", "dpo"))
    device = knob(env, "ORCH_DEVICE", "gpu")
    return RecipeEnv(
        trainer=trainer,
        trl_path=configs.required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml"),
        accel_path=configs.required(env, "ACCELERATE_CONFIG", "recipes/accelerate/fsdp2_phi3.yaml"),
        port=env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT),
        device=device,
        overrides=overrides.loads(env.get("TRL_OVERRIDES", "")),
        global_batch=batch.global_batch_of(env),
    )


def plan(
    env: Mapping[str, str],
    accelerate_config: AccelerateConfig | Mapping,
    trl_config: Mapping,
    accelerate_file: Path | None = None,
    cpus: int | None = None,
    cluster: Topology | None = None,
) -> NodePlan:
    """Pure: decide the argv of this node from its env and the recipe's two parsed configs (`plan(env, *paired)`
    with a core.configs.Configs).

    accelerate_file: the file accelerate reads (where a TRL profile resolved to); default ACCELERATE_CONFIG.
    cpus: CPU cores this node may use (None on the launch side, which does not know the node's machine).
    cluster: the topology, when the caller has read it from the env already.
    """
    cluster = cluster or from_env(env)
    check_knobs(env)
    recipe = read_recipe_env(env)
    settings = overrides.effective(trl_config, recipe.overrides)
    accelerate_config = AccelerateConfig.of(accelerate_config, f"Accelerate config {recipe.accel_path}")
    accelerate_schema.check_config(accelerate_config.raw, recipe.accel_path)
    rules.check_output_dir(settings, env)
    rules.check_hub_push(settings)
    rules.check_strategy_settings(settings, recipe.device, recipe.accel_path)
    rules.check_final_model_is_written(accelerate_config, recipe.accel_path)
    rules.check_nvme_paths(accelerate_config, recipe.accel_path)
    rules.check_reference_model_loading(recipe.trainer, accelerate_config, settings, recipe.accel_path)
    rules.check_recomputed_dropout(accelerate_config, settings, recipe.accel_path)
    rules.check_gpu_ids(accelerate_config, cluster.gpus_per_node, recipe.accel_path)

    # A vLLM server node (GRPO, VLLM_SERVER_NODES=1) does not train: the others form the training job.
    serving = vllm.server_nodes(env, cluster, recipe.trainer)
    if serving and cluster.node_rank >= cluster.nodes - serving:
        argv = vllm.server_argv(env, settings, cluster.gpus_per_node)
        return NodePlan(argv=argv, topology=cluster, cluster=cluster, runs_as="vLLM server", role="vllm-server",
                        trainer=recipe.trainer, settings=settings)  # fmt: skip
    if serving and len(set(cluster.node_ips)) < cluster.nodes and cluster.source in ("Kubeflow", "torchrun"):
        raise OrchError(
            f"VLLM_SERVER_NODES={serving}: a vLLM server node needs its own address, and {cluster.source}'s variables "
            "name the head node only; run GRPO with vLLM colocated (VLLM_SERVER_NODES=0) there"
        )
    vllm.check_mode(serving, settings, recipe.trainer)  # on the trainers (every launch's previews have one)
    trainers = cluster._replace(nodes=cluster.nodes - serving, node_ips=cluster.node_ips[: cluster.nodes - serving])
    decided = vllm.trainer_arguments(env, cluster) if serving else []

    total = trainers.total_gpus
    sizes = strategy.parallel_sizes(accelerate_config, recipe.device, total)
    data_parallel = total
    if sizes is not None:
        data_parallel = sizes.data_parallel(total)
        rules.check_packing(recipe.trainer, sizes, settings)
        rules.check_packed_attention(accelerate_config, sizes, settings, recipe.device, recipe.accel_path)
        pad = parallel.pad_to_multiple_of(sizes, settings)
        decided += ["--pad_to_multiple_of", pad] if pad else []
    # the trainer's own batch rules first, then the accumulation: the choices either refusal offers pass both
    rules.check_trainer_batch(recipe.trainer, recipe.global_batch, settings,
                              batch.per_device_batch(settings) * data_parallel, total)  # fmt: skip
    spec = trainer_specs.spec(recipe.trainer)
    multiple = batch.generations(settings, spec.generations_default) if spec.generates else 1
    ga = batch.accumulation_steps(recipe.global_batch, settings, data_parallel, recipe.overrides,
                                  trainers.gpus_per_node, parallel.ranks_of(sizes),
                                  spec.min_micro_batch, multiple)  # fmt: skip
    accumulation = (
        ga
        if ga is not None
        else batch.positive_int(settings.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    )
    config_file = accelerate_file or Path(recipe.accel_path)
    port = str(cluster.port) if cluster.port else recipe.port  # Kubeflow/torchrun dictate theirs
    flags = launcher.flags(
        accelerate_config, config_file, recipe.accel_path, recipe.device, trainers, port, sizes, accumulation
    )
    node_env: dict[str, str] = {}
    note = None
    if recipe.device == "gpu":
        node_env, note = rules.cpu_threads(strategy.of(accelerate_config).offload, env, cpus, trainers.gpus_per_node)
    argv = script.arguments(
        env,
        recipe.trainer,
        recipe.trl_path,
        recipe.overrides,
        decided=decided,
        accumulation=ga,
        device_args=flags.script_args,
    )
    return NodePlan(
        argv=flags.argv + argv,
        topology=trainers,
        cluster=cluster,
        runs_as=flags.runs_as,
        gradient_accumulation_steps=ga,
        per_device_batch=batch.per_device_batch(settings),
        data_parallel_size=data_parallel,
        notes=flags.notes + ((note,) if note else ()),
        env=node_env,
        trainer=recipe.trainer,
        settings=settings,
        sizes=sizes,
    )


def plan_from_env(env: Mapping[str, str], cpus: int | None = None) -> NodePlan:
    """Read the config files named by the env, then `plan()`."""
    cluster = from_env(env)  # SkyPilot variable problems are reported before file problems
    return plan(env, *configs.load(env), cpus=cpus, cluster=cluster)


def describe(cluster: Topology) -> str:
    """One line saying where this node is, as its environment told it (`orch node --print` starts with it)."""
    return (
        f"# {cluster.source}: node {cluster.node_rank} of {cluster.nodes}, {cluster.gpus_per_node} process(es) per "
        f"node, head {cluster.head_ip}" + (f":{cluster.port}" if cluster.port else "")
    )


def render(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """The argv as one shell-quoted line, prefixed by the variables the node sets (`OMP_NUM_THREADS=12 ...`)."""
    import shlex

    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), *map(shlex.quote, argv)])
