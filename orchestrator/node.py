"""Node side: SkyPilot's environment -> the exact `accelerate launch` argv for the recipe's TRL trainer.

`plan()` is pure (an env mapping and two parsed configs in, an argv list out); `node_exec.run()` reads the
files, passes orch's barrier, then prints or execs. Nothing heavy is imported here: the node must start
training with no delay of its own.

Variables read (all set by SkyPilot or by the recipe's `envs:`):
  SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE  (SkyPilot)
  TRL_TRAINER        sft | dpo | grpo | kto | reward
  TRL_CONFIG         path of the TRL config (YAML of the trainer's arguments)
  ACCELERATE_CONFIG  path of the Accelerate config, or a TRL profile name (zero1..3, fsdp1, fsdp2, multi_gpu)
  GLOBAL_BATCH_SIZE  optional: samples per optimizer step over all ranks; sets gradient_accumulation_steps
  TRL_OVERRIDES      optional: `key=value` words appended to the TRL script's arguments
  MAIN_PROCESS_PORT  optional: rendezvous port on the head node (default 29500; SkyPilot's Ray uses 6380)
  VLLM_SERVER_NODES  optional: 1 makes the last node run `trl vllm-serve` (GRPO); the others train
  VLLM_SERVER_PORT   optional: that server's port (default 8000)
  CHECKPOINT_ROOT    optional: output_dir becomes CHECKPOINT_ROOT/SKYPILOT_TASK_ID (a bucket mount on a cloud:
                     the task id is stable across managed-job recoveries, so a recovered job resumes)
  DDP_TIMEOUT        optional: seconds a collective may wait before the process group fails (TRL's ddp_timeout)
  OMP_NUM_THREADS    optional: CPU threads per process; orch sets cores / processes per node when the recipe
                     offloads to CPU (DeepSpeed's CPU Adam, FSDP offload), where torchrun would set 1
  ORCH_RENDEZVOUS_TIMEOUT, ORCH_BARRIER_PORT  optional: orch's pre-launch barrier (default 600 s, port + 1)
  ORCH_DEVICE        optional: `cpu` makes every process a CPU process (the local backend sets it)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator import accelerate_schema, batch, overrides, parallel
from orchestrator.errors import OrchError
from orchestrator.topology import Topology, from_env

TRAINERS = ("sft", "dpo", "grpo", "kto", "reward")
# TRL's Accelerate profile names (trl/accelerate_configs/<name>.yaml) and what each asks for.
PROFILE_TYPES = {
    "zero1": "DEEPSPEED",
    "zero2": "DEEPSPEED",
    "zero3": "DEEPSPEED",
    "fsdp1": "FSDP",
    "fsdp2": "FSDP",
    "multi_gpu": "MULTI_GPU",
    "single_gpu": "NO",
}
PROFILES = tuple(PROFILE_TYPES)
DEFAULT_PORT = 29500
CPU_CONFIG = Path(__file__).parent / "configs" / "cpu.yaml"
TRAIN_MODULE = "orchestrator.train"


class NodePlan(NamedTuple):
    """What one node will run."""

    argv: list[str]
    """The full `accelerate launch ...` command, as an argv list (never a shell string)."""
    topology: Topology
    distributed_type: str
    """What the Accelerate config asks for: FSDP, DEEPSPEED, MULTI_GPU or NO."""
    runs_as: str
    """What will really run: the config's type on GPUs, `DDP over gloo` on CPU."""
    gradient_accumulation_steps: int | None = None
    per_device_batch: int | None = None
    data_parallel_size: int | None = None
    """Ranks that see different samples: total processes / (cp x sp x tp)."""
    parallel_sizes: parallel.Sizes | None = None
    """The refit parallelism_config sizes, when the Accelerate config has one (GPU only)."""
    role: str = "trainer"
    """`trainer`, or `vllm-server` for the node that runs TRL's vLLM server."""
    notes: tuple[str, ...] = ()
    env: dict[str, str] = {}
    """Variables the node sets before it execs the argv (never secrets: those are in the node's own env)."""


def _required(env: Mapping[str, str], name: str, example: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise OrchError(f"{name} is not set; the recipe's `envs:` must give it (for example {name}: {example})")
    return value


def resolve_accelerate_config(value: str, strict: bool = True) -> Path:
    """A path, or one of TRL's profile names (looked up in the installed trl package, as `trl --accelerate_config`).

    With strict=False (previews on a laptop without trl) a profile resolves to `trl/accelerate_configs/<name>.yaml`.
    """
    if value in PROFILES:
        import importlib.util

        spec = importlib.util.find_spec("trl")
        if spec is None or spec.origin is None:
            if not strict:
                return Path("trl") / "accelerate_configs" / f"{value}.yaml"
            raise OrchError(
                f"ACCELERATE_CONFIG={value} names a TRL profile but trl is not installed: pip install '.[train]'"
            )
        return Path(spec.origin).parent / "accelerate_configs" / f"{value}.yaml"
    return Path(value)


def _vllm_server_nodes(env: Mapping[str, str], topo: Topology) -> int:
    raw = env.get("VLLM_SERVER_NODES", "").strip() or "0"
    if raw not in ("0", "1"):
        raise OrchError(f"VLLM_SERVER_NODES={raw!r}: orch runs TRL's vLLM server on 0 or 1 node (the last one)")
    if raw == "1" and topo.nodes < 2:
        raise OrchError("VLLM_SERVER_NODES=1 needs at least 2 nodes (one trains, the last serves): pass --nodes 2")
    return int(raw)


def _vllm_server_argv(env: Mapping[str, str], trl_config: Mapping, user: Mapping[str, str], gpus: int) -> list[str]:
    """`trl vllm-serve` on the last node: data-parallel over its GPUs unless VLLM_TENSOR_PARALLEL_SIZE says."""
    model = user.get("model_name_or_path", trl_config.get("model_name_or_path"))
    if not model:
        raise OrchError("the TRL config names no model_name_or_path for the vLLM server")
    tp_raw = env.get("VLLM_TENSOR_PARALLEL_SIZE", "").strip() or "1"
    if not tp_raw.isdigit() or int(tp_raw) < 1 or gpus % int(tp_raw):
        raise OrchError(f"VLLM_TENSOR_PARALLEL_SIZE={tp_raw!r} must divide the {gpus} GPUs of the vLLM node")
    tp = int(tp_raw)
    return [
        "trl",
        "vllm-serve",
        "--model",
        str(model),
        "--tensor_parallel_size",
        str(tp),
        "--data_parallel_size",
        str(gpus // tp),
        "--host",
        "0.0.0.0",
        "--port",
        env_port(env, "VLLM_SERVER_PORT", 8000),
    ]


def checkpoint_dir(root: str, task_id: str) -> str:
    """Where a run keeps its checkpoints: one directory per task id under CHECKPOINT_ROOT."""
    return f"{root.rstrip('/')}/{task_id}"


def env_port(env: Mapping[str, str], name: str, default: int) -> str:
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise OrchError(f"{name}={raw!r} is not a TCP port (1-65535)")
    return raw


def _setting(trl_config: Mapping, user: Mapping[str, str], key: str, default=None):
    """The value the TRL script will see: a key=value override, else the TRL config's, else the default."""
    value = user.get(key, trl_config.get(key))
    return default if value is None else value


def _true(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def offloads_to_cpu(accelerate_config: Mapping) -> bool:
    """DeepSpeed optimizer/parameter offload or FSDP parameter offload: the optimizer step runs on CPU threads."""
    ds = accelerate_config.get("deepspeed_config") or {}
    fsdp = accelerate_config.get("fsdp_config") or {}
    devices = (str(ds.get("offload_optimizer_device", "none")), str(ds.get("offload_param_device", "none")))
    return any(d.lower() not in ("none", "") for d in devices) or _true(fsdp.get("fsdp_offload_params", False))


def _check_final_model_is_written(accelerate_config: Mapping, accel_path: str) -> None:
    """ZeRO-3 without 16-bit gathering on save writes only a DeepSpeed checkpoint, which transformers cannot load.

    (FSDP's sharded state dict is handled in the training process: orch gathers a full state dict at the end.)
    """
    ds = accelerate_config.get("deepspeed_config") or {}
    if str(accelerate_config.get("distributed_type", "")).upper() != "DEEPSPEED" or ds.get("deepspeed_config_file"):
        return  # a DeepSpeed JSON says stage3_gather_16bit_weights_on_model_save itself: the rehearsal checks it
    if str(ds.get("zero_stage", "")) == "3" and not _true(ds.get("zero3_save_16bit_model", False)):
        raise OrchError(
            f"{accel_path}: ZeRO-3 without zero3_save_16bit_model writes the final model as a DeepSpeed checkpoint "
            "that transformers cannot load; set deepspeed_config.zero3_save_16bit_model: true"
        )


def _check_packing(trainer: str, sizes: parallel.Sizes, trl_config: Mapping, user: Mapping[str, str]) -> None:
    """TRL's SFTTrainer refuses packing with context parallelism: ring attention drops the block-diagonal mask."""
    if trainer != "sft" or sizes.cp < 2:
        return
    for key in ("packing", "eval_packing"):
        if _true(_setting(trl_config, user, key, False)):
            raise OrchError(
                f"{key} is on, but TRL's SFTTrainer refuses packing with context parallelism (cp_size={sizes.cp}): "
                f"ring attention drops the mask that keeps packed documents apart; set {key}=false"
            )


def plan(
    env: Mapping[str, str],
    accelerate_config: Mapping,
    trl_config: Mapping,
    accel_file: Path | None = None,
    cpus: int | None = None,
) -> NodePlan:
    """Pure: decide the argv of this node from its env and the two parsed config files.

    accel_file: where a TRL profile name resolved to (the argv names that file); None for a plain path.
    cpus: CPU cores this node may use (None on the launch side, which does not know the node's machine).
    """
    topo = from_env(env)
    trainer = _required(env, "TRL_TRAINER", "dpo")
    if trainer not in TRAINERS:
        raise OrchError(f"TRL_TRAINER={trainer!r} is not a trainer orch runs; use one of {', '.join(TRAINERS)}")
    trl_path = _required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml")
    accel_path = _required(env, "ACCELERATE_CONFIG", "recipes/accelerate/fsdp2_phi3.yaml")
    port = env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT)
    device = env.get("ORCH_DEVICE", "gpu").strip().lower() or "gpu"
    if device not in ("gpu", "cpu"):
        raise OrchError(f"ORCH_DEVICE={device!r}: use gpu or cpu")
    user = overrides.loads(env.get("TRL_OVERRIDES", ""))
    accelerate_schema.check_config(accelerate_config, accel_path)
    _check_final_model_is_written(accelerate_config, accel_path)
    asked = str(accelerate_config.get("distributed_type", "NO")).upper()
    notes: list[str] = []

    # A vLLM server node (GRPO, VLLM_SERVER_NODES=1) does not train: the others form the training job.
    serving = _vllm_server_nodes(env, topo)
    trainers = Topology(topo.nodes - serving, topo.gpus_per_node, topo.node_rank, topo.node_ips[: topo.nodes - serving])
    script_extra: list[str] = []
    if serving:
        if trainer != "grpo":
            raise OrchError(f"VLLM_SERVER_NODES=1 is for GRPO; TRL_TRAINER is {trainer}: set VLLM_SERVER_NODES: 0")
        if topo.node_rank >= trainers.nodes:
            argv = _vllm_server_argv(env, trl_config, user, topo.gpus_per_node)
            return NodePlan(
                argv=argv, topology=topo, distributed_type="vLLM server", runs_as="vLLM server", role="vllm-server"
            )
        script_extra += [
            "--vllm_server_host",
            topo.node_ips[-1],
            "--vllm_server_port",
            env_port(env, "VLLM_SERVER_PORT", 8000),
        ]
    total = trainers.total_gpus

    launch = ["accelerate", "launch"]
    sizes = None
    node_env: dict[str, str] = {}
    if device == "cpu":
        # accelerate's --cpu path with several machines starts independent trainings (no process group):
        # use torchrun's path (--multi_gpu) with a CPU config, and tell the TRL script use_cpu.
        launch += ["--config_file", str(CPU_CONFIG)]
        if total > 1:
            launch += ["--multi_gpu"]
        runs_as = "DDP over gloo" if total > 1 else "single process"
        if asked in ("FSDP", "DEEPSPEED") or parallel.declared(accelerate_config):
            notes.append(
                f"the recipe asks for {asked} ({accel_path}); on CPU orch runs {runs_as} instead "
                "(same data, batch and optimizer steps; no sharding, no context/sequence parallelism)"
            )
    else:
        launch += ["--config_file", str(accel_file) if accel_file else accel_path]
        runs_as = asked
        sizes = parallel.declared(accelerate_config)
        if offloads_to_cpu(accelerate_config) and not env.get("OMP_NUM_THREADS", "").strip():
            # torchrun sets OMP_NUM_THREADS=1 when it is unset (accelerate's DeepSpeed path never sets it), which
            # leaves DeepSpeed's CPU Adam and FSDP's CPU optimizer step one thread per process.
            if cpus:
                node_env["OMP_NUM_THREADS"] = str(max(1, cpus // trainers.gpus_per_node))
            notes.append(
                "the optimizer steps on CPU (offload): OMP_NUM_THREADS = the node's cores / "
                f"{trainers.gpus_per_node} processes" + (f" = {node_env['OMP_NUM_THREADS']}" if cpus else "")
            )
    launch += [
        "--num_processes",
        str(total),
        "--num_machines",
        str(trainers.nodes),
        "--machine_rank",
        str(trainers.node_rank),
        "--main_process_ip",
        trainers.head_ip,
        "--main_process_port",
        port,
        # Config-file values are ignored when accelerate has a CLI default: pass them as flags.
        "--rdzv_backend",
        "static",
        "--same_network",
    ]
    if device == "gpu" and asked == "DEEPSPEED":
        launch += ["--deepspeed_multinode_launcher", "standard"]  # else pdsh + hostfile
    data_parallel = total
    if sizes is not None:
        parallel.check_backend(sizes, accelerate_config)
        sizes = parallel.refit(sizes, total)
        launch += sizes.flags()
        data_parallel = sizes.data_parallel(total)
        _check_packing(trainer, sizes, trl_config, user)
        pad = parallel.pad_to_multiple_of(sizes, trl_config, user)
        if pad is not None:
            script_extra += ["--pad_to_multiple_of", pad]

    ga = batch.accumulation_steps(env, trl_config, user, data_parallel_size=data_parallel)
    if device == "gpu" and asked == "DEEPSPEED":
        # accelerate exports a config's deepspeed_config.gradient_accumulation_steps (TRL's zero1 profile has 1)
        # to DeepSpeed, and transformers stops at train() when it differs from the TRL script's value: give
        # accelerate the same number (its flag wins over the config file).
        steps = (
            ga
            if ga is not None
            else batch.positive_int(
                _setting(trl_config, user, "gradient_accumulation_steps", 1), "gradient_accumulation_steps"
            )
        )
        launch += ["--gradient_accumulation_steps", str(steps)]
    if trainer == "grpo":
        batch.check_generations(env, trl_config, user)
    if trainer == "kto" and batch.per_device_batch(trl_config, user) < 2:
        raise OrchError(
            "KTO needs per_device_train_batch_size >= 2: its KL baseline pairs mismatched samples of one micro-batch"
        )
    root = env.get("CHECKPOINT_ROOT", "").strip()
    if root:  # run-keyed: a recovered managed job (same task id) finds its checkpoints
        task_id = env.get("SKYPILOT_TASK_ID", "").strip()
        if not task_id:
            raise OrchError("CHECKPOINT_ROOT is set but SKYPILOT_TASK_ID is not; SkyPilot sets it on every node")
        user = {k: v for k, v in user.items() if k != "output_dir"}
        script_extra += ["--output_dir", checkpoint_dir(root, task_id)]
    timeout = env.get("DDP_TIMEOUT", "").strip()
    if timeout:
        if not timeout.isdigit() or int(timeout) < 1:
            raise OrchError(f"DDP_TIMEOUT={timeout!r} must be a whole number of seconds")
        script_extra += ["--ddp_timeout", timeout]
    script = ["--module", TRAIN_MODULE, trainer, "--config", trl_path, *overrides.to_argv(user, trainer), *script_extra]
    if ga is not None:
        script += ["--gradient_accumulation_steps", str(ga)]
    if device == "cpu":
        script += ["--use_cpu", "true"]
    return NodePlan(
        argv=launch + script,
        topology=trainers,
        distributed_type=asked,
        runs_as=runs_as,
        gradient_accumulation_steps=ga,
        per_device_batch=batch.per_device_batch(trl_config, user),
        data_parallel_size=data_parallel,
        parallel_sizes=sizes,
        notes=tuple(notes),
        env=node_env,
    )


def _load_yaml(path: Path, what: str) -> dict:
    from orchestrator import yamlio

    try:
        text = path.read_text()
    except OSError as exc:
        raise OrchError(f"{what} {path} cannot be read ({exc.strerror}); check the path in the recipe's envs") from None
    try:
        data = yamlio.load(text)
    except yamlio.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        raise OrchError(f"{what} {path} is not valid YAML{where}; fix the file") from None
    if not isinstance(data, dict):
        raise OrchError(f"{what} {path} must be a YAML mapping of settings")
    return data


def _profile_stub(profile: str) -> dict:
    """What a TRL profile asks for, when trl (and so the profile file) is not installed here."""
    stub: dict = {"distributed_type": PROFILE_TYPES[profile]}
    if profile.startswith("zero"):
        stub["deepspeed_config"] = {"zero_stage": int(profile[-1])}
    if profile.startswith("fsdp"):
        stub["fsdp_config"] = {"fsdp_version": int(profile[-1])}
    return stub


def load_configs(env: Mapping[str, str], strict: bool = True) -> tuple[dict, dict, Path | None]:
    """The Accelerate config (parsed), the TRL config (parsed) and the resolved profile file, if any."""
    value = _required(env, "ACCELERATE_CONFIG", "recipes/accelerate/fsdp2_phi3.yaml")
    trl = _load_yaml(Path(_required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml")), "TRL config")
    if value in PROFILES:
        path = resolve_accelerate_config(value, strict=strict)
        accel = _load_yaml(path, "Accelerate config") if path.is_file() else _profile_stub(value)
        return accel, trl, path
    return _load_yaml(Path(value), "Accelerate config"), trl, None


def plan_from_env(env: Mapping[str, str], cpus: int | None = None) -> NodePlan:
    """Read the two config files named by the env, then `plan()`."""
    from_env(env)  # report SkyPilot variable problems before file problems
    accel, trl, profile_file = load_configs(env)
    return plan(env, accel, trl, profile_file, cpus=cpus)


def preview(
    task_envs: Mapping[str, str],
    nodes: int,
    gpus_per_node: int,
    device: str = "gpu",
    task_id: str = "$SKYPILOT_TASK_ID",
    configs: tuple[dict, dict, Path | None] | None = None,
) -> list[NodePlan]:
    """The plan of every node rank of a task, computed on the launch side from the env SkyPilot will set.

    Node IPs (10.0.0.1, ...) and the task id are placeholders: SkyPilot assigns the real ones.
    configs: what `load_configs(task_envs, strict=False)` returns, when the caller has read them already.
    """
    base = {"SKYPILOT_TASK_ID": task_id, **task_envs}
    if device == "cpu":
        base["ORCH_DEVICE"] = "cpu"
    base.update(
        SKYPILOT_NODE_IPS="".join(f"10.0.0.{i + 1}\n" for i in range(nodes)),
        SKYPILOT_NUM_NODES=str(nodes),
        SKYPILOT_NUM_GPUS_PER_NODE=str(gpus_per_node),
    )
    accel, trl, profile_file = configs or load_configs(base, strict=False)
    return [plan({**base, "SKYPILOT_NODE_RANK": str(rank)}, accel, trl, profile_file) for rank in range(nodes)]


def render(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """The argv as one shell-quoted line, prefixed by the variables the node sets (`OMP_NUM_THREADS=12 ...`)."""
    import shlex

    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), *map(shlex.quote, argv)])
