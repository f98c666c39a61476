"""Rehearse one rank role of a launch against the owners' code: no GPU, no weights, no network.

`python -m orchestrator.rehearsal.role` reads the roles of one or many launches as JSON on stdin, imports the
training stack once, builds the tiny smoke artifacts they need, and forks one child per role (a few at a time); it
prints one JSON result line per role. For a trainer role it does what the node and its first process would do, with
the owners' code at every step:
  1. accelerate: `launch_command_parser`, `_validate_launch_command` (config merge), the env builder of the
     launch's path (`prepare_multi_gpu_env` / `prepare_deepspeed_cmd_env`), then torchrun's own
     `config_from_args` (which sets OMP_NUM_THREADS), giving the environment the training process starts with;
  2. the training process: a fake process group of the launch's world size (torch's `fake` backend) and CUDA
     reported present with the node's GPU count, then orch's training entry parses with TRL's parser, makes the
     trackers report_to names as the trainer would (not started), and builds TRL's trainer (accelerate's FSDP /
     DeepSpeed / parallelism plugins from that environment, the trainer's own checks); the optimizer and the
     scheduler are looked up and made as `train()` would, DeepSpeed's config finalized by transformers; the final
     model is saved as the end of training would (FSDP: the gathered full state dict), into a temporary directory.
The model is the tiny smoke model of the recipe's family and the data the smoke data: the checks that fire at
trainer start depend on the configuration, not on the weights. The vLLM server role is parsed with TRL's
`vllm-serve` parser. Only the main process of the node is built (local rank 0 of node rank R).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from orchestrator.rehearsal import fake_gpu, probes
from orchestrator.rehearsal.data import quiet


class StageError(Exception):
    def __init__(self, stage: str, exc: BaseException):
        text = " ".join(str(exc).split()) or type(exc).__name__
        super().__init__(f"{type(exc).__name__}: {text[:600]}")
        self.stage = stage


@contextlib.contextmanager
def stage(name: str):
    try:
        yield
    except StageError:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure of the owners' code is the finding
        if os.environ.get("ORCH_DEBUG"):
            import traceback

            traceback.print_exc(file=sys.__stderr__)
        raise StageError(name, exc) from exc


def accelerate_stage(argv: list[str]) -> tuple[dict[str, str], list[str], dict]:
    """The environment and argv torchrun gives the node's first training process, from accelerate's own code."""
    from accelerate.commands import launch as launch_cmd
    from accelerate.utils import launch as launch_utils
    from accelerate.utils import patch_environment

    launch_utils.is_port_in_use = lambda port: False  # the laptop's ports say nothing about the head node's
    assert argv[:2] == ["accelerate", "launch"], argv[:2]
    args = launch_cmd.launch_command_parser().parse_args(argv[2:])
    args, defaults, mp_from_config = launch_cmd._validate_launch_command(args)
    facts = {"mixed_precision": str(args.mixed_precision)}
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + (["mixed_precision"] if mp_from_config else [])
        )
        cmd, env = launch_utils.prepare_deepspeed_cmd_env(args)
        if cmd is not None:
            raise ValueError(f"accelerate would start DeepSpeed's {cmd[0]} launcher (pdsh + hostfile), not torchrun")
        facts["path"] = "deepspeed"
    elif args.use_fsdp or args.multi_gpu:
        env = launch_utils.prepare_multi_gpu_env(args)
        facts["path"] = "fsdp" if args.use_fsdp else "multi_gpu"
    else:
        raise ValueError("accelerate would use its simple launcher: one process, no process group")
    import torch.distributed.run as distrib_run

    targs = launch_cmd._filter_args(args, distrib_run.get_args_parser(), ["--training_script", args.training_script,
                                    "--training_script_args", args.training_script_args])  # fmt: skip
    # torch's logs spec makes a torchelastic_* directory in the temporary directory when no log dir is given, and never
    # removes it: every rehearsed role left one (on the laptop at every uncached `orch run`)
    with tempfile.TemporaryDirectory(prefix="orch-rehearsal-logs-") as logs, patch_environment(**env):
        targs.log_dir = targs.log_dir or logs
        _config, _cmd, _cmd_args = distrib_run.config_from_args(targs)
        child = dict(os.environ)
    nproc, nnodes, node_rank = int(targs.nproc_per_node), int(targs.nnodes.split(":")[-1]), int(targs.node_rank)
    child.update(
        LOCAL_RANK="0",
        RANK=str(node_rank * nproc),
        GROUP_RANK=str(node_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        WORLD_SIZE=str(nproc * nnodes),
        MASTER_ADDR=str(targs.master_addr),
        MASTER_PORT=str(targs.master_port),
    )
    facts.update(world_size=nproc * nnodes, rank=node_rank * nproc, omp_num_threads=child.get("OMP_NUM_THREADS"))
    script = [args.training_script, *args.training_script_args]
    return child, script, facts


def trainer_stage(
    script: list[str], child_env: dict[str, str], substitute: list[str], devices: int, nvme: bool = False
) -> dict:
    """Build the trainer the node's first process would build; finalize DeepSpeed's config; save the final model.
    `nvme`: DeepSpeed offloads to NVMe here, as it is (the head node), so its libaio check comes first."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.clear()
    os.environ.update(child_env)
    if child_env.get("ACCELERATE_USE_DEEPSPEED") == "true":
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory collective (a C++ build, minutes, and a compiler
        # the laptop may lack) when its comm backend starts; the rehearsal never communicates.
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch is torch)
        if devices:
            fake_gpu.deepspeed_dtypes()
    dist.init_process_group(
        "fake", store=FakeStore(), rank=int(child_env["RANK"]), world_size=int(child_env["WORLD_SIZE"])
    )
    if script[:2] != ["-m", "orchestrator.train"] and script[0] != "orchestrator.train":
        raise ValueError(f"the node would run {script[0]}, not orch's training entry")
    from orchestrator.train import checkpoints, entry, ran

    args = script[1:] if script[0] == "orchestrator.train" else script[2:]
    said = io.StringIO()  # argparse prints what it refuses, then exits 2: the finding is that line, not "SystemExit: 2"
    with stage("TRL's parser"), contextlib.redirect_stderr(said):
        try:
            parsed = entry.parse([*args, *substitute])
        except SystemExit as exc:
            errors = [line.split(": error: ", 1)[1] for line in said.getvalue().splitlines() if ": error: " in line]
            raise ValueError(errors[-1] if errors else f"the parser exited with {exc.code}") from None
    with stage("trackers (report_to)"):
        probes.trackers(parsed.training_args)
    with stage("trainer"):
        if nvme:
            probes.async_io()
        trainer = entry.build(parsed, [])
    if "--attn_implementation" in substitute:  # the attention the nodes load, which the rehearsal swapped for SDPA
        with stage("attention (attn_implementation)"):
            probes.attention(probes.requested_attention(args), trainer.model)
    acc = trainer.accelerator
    ds_optimizer = trainer.is_deepspeed_enabled and "optimizer" in acc.state.deepspeed_plugin.hf_ds_config.config
    if not ds_optimizer:  # the optimizer optim names, as train() looks it up first (its package, its arguments)
        with stage("optimizer (optim)"):
            trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    if not (trainer.is_deepspeed_enabled and "scheduler" in acc.state.deepspeed_plugin.hf_ds_config.config):
        with stage("scheduler (lr_scheduler_type)"):  # with its lr_scheduler_kwargs, as train() makes it
            probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=trainer.args.learning_rate)
            trainer.create_scheduler(trainer.args.max_steps if trainer.args.max_steps > 0 else 1000, probe)
            trainer.lr_scheduler = None
    if acc.scaler is not None and not trainer.is_fsdp_enabled:  # fp16 outside FSDP (which trains fp32 weights)
        with stage("gradient scaler (fp16)"):
            probes.unscale(acc.scaler, trainer.model)
    facts = {
        "distributed_type": acc.distributed_type.value,
        "device": acc.device.type,  # cuda, as the fake GPU reports it, unless a setting asks for the CPU
        "num_processes": acc.num_processes,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
    }
    if getattr(trainer, "reward_funcs", None):  # GRPO, RLOO: each reward function, as the first step will call it
        with stage("reward functions"):
            facts["rewards"] = probes.call_rewards(trainer)
    if acc.ddp_handler is not None and acc.distributed_type.value in ("MULTI_GPU", "MULTI_CPU"):  # as DDP will get it
        facts["ddp_find_unused_parameters"] = bool(acc.ddp_handler.find_unused_parameters)
    adapter = ran.adapter_facts(trainer.model)  # PEFT: an adapter trains, the base stays frozen (4-bit: QLoRA)
    if adapter:
        facts["trainable_params"], facts["linear4bit"] = adapter["trainable_params"], adapter["linear4bit"]
    if acc.parallelism_config is not None:
        pc = acc.parallelism_config
        facts["parallelism"] = {k: getattr(pc, f"{k}_size") for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    if trainer.is_deepspeed_enabled:
        hf = acc.state.deepspeed_plugin.hf_ds_config
        with stage("transformers' DeepSpeed config"):
            steps = trainer.args.max_steps if trainer.args.max_steps > 0 else 1000
            hf.trainer_config_finalize(trainer.args, trainer.model, steps)
        with stage("DeepSpeed's config"):
            probes.deepspeed_config(hf.config)
        facts["zero_stage"] = hf.get_value("zero_optimization.stage")
        if hf.is_zero3() and not hf.get_value("zero_optimization.stage3_gather_16bit_weights_on_model_save"):
            raise StageError(
                "final model",
                ValueError(
                    "ZeRO-3 without stage3_gather_16bit_weights_on_model_save: the final model would be a "
                    "DeepSpeed checkpoint that transformers cannot load"
                ),
            )
        facts["final_model"] = "16-bit weights gathered by DeepSpeed at the end" if hf.is_zero3() else "whole weights"
    else:
        if trainer.is_fsdp_enabled:
            facts["fsdp_state_dict_type"] = str(acc.state.fsdp_plugin.state_dict_type).split(".")[-1]
        with stage("final model"), tempfile.TemporaryDirectory(prefix="orch-rehearsal-") as out:
            final = checkpoints.save_final_model(trainer, out)
            if final is not None and not final["loadable"]:
                raise ValueError("the final model would not be written in Hugging Face format")
        facts["final_model"] = "full state dict" if trainer.is_fsdp_enabled else "whole weights"
        if final is not None and "adapter_model.safetensors" in final["weights"]:
            facts["final_model"] = "LoRA adapter" + (" (full state dict gathered)" if trainer.is_fsdp_enabled else "")
    if trainer.args.use_liger_kernel:  # as train() does first (transformers' own function; it patches, runs nothing)
        from transformers.integrations.liger import apply_liger_kernel

        with stage("Liger kernels"):
            apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)
        facts["liger"] = True
    return facts


def server_stage(argv: list[str]) -> dict:
    from trl.scripts.vllm_serve import make_parser

    (script_args,) = make_parser().parse_args_and_config(args=argv[2:])
    return {"model": script_args.model, "tensor_parallel_size": script_args.tensor_parallel_size}


def rehearse(spec: dict) -> dict:
    argv = spec["argv"]
    if spec.get("role") == "vllm-server":
        with stage("TRL's vllm-serve parser"):
            return server_stage(argv)
    os.environ.update(spec.get("env", {}))  # what the node sets before it execs accelerate (OMP_NUM_THREADS)
    with stage("accelerate launch"):
        child, script, facts = accelerate_stage(argv)
    with tempfile.TemporaryDirectory(prefix="orch-rehearsal-ds-") as scratch:
        if not spec.get("nvme") and (swapped := nvme_as_cpu(child, Path(scratch))):
            facts["nvme_offload"] = swapped
        nvme = bool(spec.get("nvme") and nvme_offloads(child))  # as it is, on the head node
        facts.update(trainer_stage(script, child, spec.get("substitute", []), spec.get("devices", 0), nvme))
    return facts


NVME_DEVICES = ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
DS_JSON = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def nvme_offloads(child: dict[str, str]) -> set[str]:
    """What DeepSpeed offloads to NVMe in the environment accelerate gives the first process ("param", "optimizer"): its
    devices, or its DeepSpeed JSON's."""
    return _env_nvme(child) | set(_json_nvme(_deepspeed_json(child)))


def _env_nvme(child: dict[str, str]) -> set[str]:
    return {key.split("_")[-2].lower() for key in NVME_DEVICES if child.get(key, "").lower() == "nvme"}


def _deepspeed_json(child: dict[str, str]) -> object:
    return json.loads(Path(path).read_text()) if (path := child.get(DS_JSON, "none")) != "none" else None


def _json_nvme(ds: object) -> dict[str, dict]:
    """{part: its offload block} of a DeepSpeed JSON that offloads that part to NVMe."""
    zero = ds.get("zero_optimization") if isinstance(ds, dict) else None
    blocks = {part: zero.get(f"offload_{part}") for part in ("param", "optimizer")} if isinstance(zero, dict) else {}
    return {k: v for k, v in blocks.items() if isinstance(v, dict) and str(v.get("device", "")).lower() == "nvme"}


def nvme_as_cpu(child: dict[str, str], scratch: Path) -> str:
    """DeepSpeed's NVMe offload rehearsed as CPU offload, in the environment accelerate gives the first process (its
    devices, or a copy of its DeepSpeed JSON in `scratch`): the same engine, partitioning and optimizer, without the
    async_io op the swapper JIT-builds against this machine's libaio, which says nothing about the nodes' (the head
    node rehearses NVMe as it is). Returns what was swapped, in words; '' where nothing was."""
    ds = _deepspeed_json(child)  # read once: its NVMe blocks are named and then rewritten
    blocks = _json_nvme(ds)
    swapped = _env_nvme(child) | set(blocks)
    for key in NVME_DEVICES:
        if child.get(key, "").lower() == "nvme":
            child[key] = "cpu"
    if blocks:
        for offload in blocks.values():
            offload["device"] = "cpu"
        copy = scratch / Path(child[DS_JSON]).name
        copy.write_text(json.dumps(ds))
        child[DS_JSON] = str(copy)
    parts = " and ".join(sorted(swapped))
    return f"{parts} offload to NVMe rehearsed as CPU offload (the head node rehearses NVMe)" if parts else ""


def _preimport(trainers: set[str]) -> None:
    """Import the training stack once, before the roles fork (each role then costs its own checks only)."""
    import importlib

    import torch.distributed.run  # noqa: F401
    from accelerate.commands import launch  # noqa: F401

    from orchestrator.core import trainers as specs
    from orchestrator.train import entry  # noqa: F401

    for trainer in trainers:
        getattr(importlib.import_module("trl"), specs.spec(trainer).trl_class)
    with contextlib.suppress(ImportError):  # QLoRA: a node quantises on its own GPU; here bitsandbytes' CPU kernels
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

        Bnb4BitHfQuantizer.update_device_map = lambda self, device_map: device_map or {"": "cpu"}
    if any(specs.spec(trainer).generates for trainer in trainers):
        importlib.import_module("trl.scripts.vllm_serve")


def _build_artifacts(wanted: set[tuple[str, str, str]]) -> None:
    """The tiny models and data the batches point at, built here when missing (torch is imported already)."""
    from pathlib import Path

    from orchestrator.train import smoke_build

    for model_type, trainer, folder in sorted(wanted):
        if folder and not (Path(folder) / "READY").is_file():
            smoke_build.build(model_type, trainer, Path(folder))


def _run_role(spec: dict) -> dict:
    try:
        return {"ok": True, "facts": rehearse(spec)}
    except StageError as exc:
        return {"ok": False, "stage": exc.stage, "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "stage": "rehearsal", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}


def _fork(spec: dict) -> tuple[int, int]:
    """Start one role in a forked child: its environment, patches and fake process group die with it.
    Returns (pid, the read end of the pipe its JSON result comes on)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        if spec.get("devices"):
            import torch

            torch.cuda.device_count = lambda: spec["devices"]  # this launch's GPUs per node
            fake_gpu.capability(tuple(spec["capability"]))  # the launch's GPU, driver.DEFAULT_CAPABILITY when unnamed
        with quiet():
            result = _run_role(spec)
        with os.fdopen(write_fd, "w") as out:
            out.write(json.dumps(result))
        os._exit(0)  # no teardown of the fake process group or of half-built trainers
    os.close(write_fd)
    return pid, read_fd


def _collect(pid: int, read_fd: int) -> dict:
    with os.fdopen(read_fd) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"ok": False, "stage": "rehearsal", "error": f"the rehearsal of this role died (wait status {status})"}
    return json.loads(text)


def main() -> None:
    """stdin: {"process_env", "parallel", "batches": [{"trainer", "devices", "smoke", "roles": [{"argv", "env",
    "role", "substitute"}, ...]}, ...]}; stdout: `ORCH_REHEARSAL <batch>.<role> <json>` per role."""
    request = json.loads(sys.stdin.read())
    os.environ.update(request.get("process_env", {}))
    warnings.filterwarnings("ignore")
    batches = request["batches"]
    devices = max((b["devices"] for b in batches), default=0)
    if any(b.get("bitsandbytes", True) for b in batches):
        with contextlib.suppress(ImportError):  # bitsandbytes picks its kernels at import: the CPU ones, which run here
            import bitsandbytes  # noqa: F401
    else:  # as on nodes without the quant extra (and ~1 s less here: core/bnb.py)
        from orchestrator.core import bnb

        bnb.hide()
    if devices:
        fake_gpu.cuda(devices)  # before any import that could cache "no CUDA"; each child sets its own count
    with quiet():
        _preimport({b["trainer"] for b in batches})
        _build_artifacts({tuple(b["smoke"]) for b in batches})
    jobs = [
        (f"{i}.{j}", {**role, "devices": b["devices"], "capability": b.get("capability"), "nvme": b.get("nvme")})
        for i, b in enumerate(batches)
        for j, role in enumerate(b["roles"])
    ]
    running: list[tuple[str, int, int]] = []
    width = max(1, int(request.get("parallel", 1)))
    while jobs or running:
        while jobs and len(running) < width:
            where, spec = jobs.pop(0)
            running.append((where, *_fork(spec)))
        where, pid, read_fd = running.pop(0)
        result = _collect(pid, read_fd)
        sys.__stdout__.write(f"ORCH_REHEARSAL {where} {json.dumps(result)}\n")
        sys.__stdout__.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
