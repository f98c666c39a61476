"""Node side: the `accelerate launch` flags of one node (everything before `--module`).

`--num_processes` is the TOTAL over all nodes (accelerate divides by `--num_machines`); `--rdzv_backend` and
`--same_network` are flags because accelerate ignores those config-file values; DeepSpeed always gets
`--deepspeed_multinode_launcher standard` (else pdsh + hostfile) and the accumulation the TRL script gets
(accelerate exports a config's own `deepspeed_config.gradient_accumulation_steps` to DeepSpeed, and transformers
stops at train() on a mismatch). On CPU (ORCH_DEVICE=cpu) orch's cpu.yaml with `--multi_gpu`: torchrun's path,
one gloo group (accelerate's `--cpu` launcher would start independent trainings).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import parallel
from orchestrator.core.configs import CPU_CONFIG
from orchestrator.core.topology import Topology


class Flags(NamedTuple):
    argv: list[str]
    runs_as: str
    """What will really run: the config's distributed type on GPUs, `DDP over gloo` on CPU."""
    notes: tuple[str, ...] = ()


def parallel_sizes(accelerate_config: Mapping, device: str, total: int) -> parallel.Sizes | None:
    """The Accelerate config's parallelism_config refit to `total` processes (None on CPU or without one)."""
    sizes = parallel.declared(accelerate_config)
    if device == "cpu" or sizes is None:
        return None
    parallel.check_backend(sizes, accelerate_config)
    return parallel.refit(sizes, total)


def flags(
    accelerate_config: Mapping,
    config_file: Path,
    accel_path: str,
    device: str,
    trainers: Topology,
    port: str,
    sizes: parallel.Sizes | None,
    accumulation: int,
) -> Flags:
    """accumulation: the gradient_accumulation_steps the TRL script will use (given to DeepSpeed too)."""
    asked = str(accelerate_config.get("distributed_type", "NO")).upper()
    total = trainers.total_gpus
    argv = ["accelerate", "launch"]
    notes = []
    if device == "cpu":
        argv += ["--config_file", str(CPU_CONFIG)] + (["--multi_gpu"] if total > 1 else [])
        runs_as = "DDP over gloo" if total > 1 else "single process"
        if asked in ("FSDP", "DEEPSPEED") or parallel.declared(accelerate_config):
            notes.append(
                f"the recipe asks for {asked} ({accel_path}); on CPU orch runs {runs_as} instead "
                "(same data, batch and optimizer steps; no sharding, no context/sequence parallelism)"
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
    if device == "gpu" and asked == "DEEPSPEED":
        argv += ["--deepspeed_multinode_launcher", "standard"]
    if sizes is not None:
        argv += sizes.flags()
    if device == "gpu" and asked == "DEEPSPEED":
        argv += ["--gradient_accumulation_steps", str(accumulation)]
    return Flags(argv, runs_as, tuple(notes))
