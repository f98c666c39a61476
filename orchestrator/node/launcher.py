"""Node side: the `accelerate launch` flags of one node (everything before `--module`).

`--num_processes` is the TOTAL over all nodes (accelerate divides by `--num_machines`); `--rdzv_backend` and
`--same_network` are flags because accelerate ignores those config-file values; DeepSpeed always gets
`--deepspeed_multinode_launcher standard` (else pdsh + hostfile) and the accumulation the TRL script gets
(accelerate exports a config's own `deepspeed_config.gradient_accumulation_steps` to DeepSpeed, and transformers
stops at train() on a mismatch). On CPU (ORCH_DEVICE=cpu) FSDP2 and DeepSpeed ZeRO recipes keep their own config
(fp32, gloo; core.strategy.cpu_fallback says which); the rest get orch's cpu.yaml with `--multi_gpu`: torchrun's
path, one gloo group (accelerate's `--cpu` launcher would start independent trainings), DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import parallel, strategy
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.configs import CPU_CONFIG
from orchestrator.core.topology import Topology


class Flags(NamedTuple):
    argv: list[str]
    runs_as: str
    """What will really run: the config's distributed type on GPUs; on CPU `FSDP2 over gloo`, `DeepSpeed ZeRO-3 over
    gloo` or, for what cannot run there, `DDP over gloo`."""
    notes: tuple[str, ...] = ()
    script_args: tuple[str, ...] = ()
    """TRL arguments the device needs: `--use_cpu true` (CPU processes) or `--ddp_backend gloo` (DeepSpeed on CPU)."""


def flags(
    accelerate_config: AccelerateConfig | Mapping,
    config_file: Path,
    accel_path: str,
    device: str,
    trainers: Topology,
    port: str,
    sizes: parallel.Sizes | None,
    accumulation: int,
) -> Flags:
    """accumulation: the gradient_accumulation_steps the TRL script will use (given to DeepSpeed too)."""
    config = AccelerateConfig.of(accelerate_config, accel_path)
    asked = config.distributed_type
    total = trainers.total_gpus
    argv = ["accelerate", "launch"]
    notes = []
    script_args: tuple[str, ...] = ()
    sharded = asked if asked in ("FSDP", "DEEPSPEED") else None
    if device == "cpu":
        asked_strategy = strategy.of(config)
        why_not = strategy.cpu_fallback(asked_strategy, total) if sharded else "not sharded"
        if why_not is None:  # the recipe's own config, without mixed precision (fp32 on CPU)
            argv += ["--config_file", str(config_file), "--mixed_precision", "no"]
            if sharded == "FSDP":
                runs_as = f"FSDP{asked_strategy.kind[-1]} over gloo"
                script_args = ("--use_cpu", "true")  # MULTI_CPU; orchestrator/train/cpu_fsdp.py makes it FSDP
            else:
                runs_as = f"DeepSpeed ZeRO-{asked_strategy.kind[-1]} over gloo"
                script_args = ("--ddp_backend", "gloo")  # not use_cpu: accelerate's DeepSpeed path needs it off
                if asked_strategy.offload:  # the shared-memory op is never built (orchestrator/train/cpu_deepspeed.py)
                    notes.append(
                        "DeepSpeed compiles CPU Adam (ZeRO offload) on first use: a minute or two once, then cached "
                        "in ~/.cache/torch_extensions"
                    )
        else:
            sharded = None
            argv += ["--config_file", str(CPU_CONFIG)] + (["--multi_gpu"] if total > 1 else [])
            runs_as = "DDP over gloo" if total > 1 else "single process"
            script_args = ("--use_cpu", "true")
            if asked in ("FSDP", "DEEPSPEED") or config.parallelism:
                notes.append(
                    f"the recipe asks for {asked_strategy.label} ({accel_path}); on CPU orch runs {runs_as} "
                    f"instead: {why_not} (same data, batch and optimizer steps; no sharding, no context/sequence "
                    "parallelism)"
                )
    else:
        argv += ["--config_file", str(config_file)]
        runs_as = asked
    argv += [
        "--num_processes", str(total),
        "--num_machines", str(trainers.nodes),
        "--machine_rank", str(trainers.node_rank),
        "--main_process_ip", trainers.head_ip,
        "--main_process_port", port,
        "--rdzv_backend", "static",
        "--same_network",
    ]  # fmt: skip
    if sharded == "DEEPSPEED":  # on GPUs, and on CPU where ZeRO runs for real
        argv += ["--deepspeed_multinode_launcher", "standard"]
    if sizes is not None:
        argv += sizes.flags()
        named = config.sp_attn_implementation
        if device == "cpu" and sizes.sp > 1 and named not in (None, "sdpa"):  # flash kernels need a GPU
            argv += ["--parallelism_config_sp_attn_implementation", "sdpa"]
            notes.append(f"Ulysses wraps SDPA on CPU, not the recipe's {named}")
    if sharded == "DEEPSPEED":  # on GPUs, and on CPU where ZeRO runs for real
        argv += ["--gradient_accumulation_steps", str(accumulation)]
    return Flags(argv, runs_as, tuple(notes), script_args)
