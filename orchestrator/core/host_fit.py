"""Does a node's host memory hold a run: the busiest node's peak while loading and, with CPU offload, the node's share
of the offloaded states while training. Checked on both sides as core/fit.py's GPU rules are: by the launch side
against SkyPilot's planned node (launch/preflight.py), by the head node against its own MemTotal or cgroup limit
(node/memory.py)."""

from __future__ import annotations

import math

from orchestrator.core import load_memory, memory
from orchestrator.core.errors import OrchError
from orchestrator.core.fit import gib

# Of a node's host memory loading may take: the OS, the page cache's own slack and SkyPilot's runtime need the rest.
HOST_USABLE_FRACTION = 0.9


def offloaded_gib(setup: memory.Setup | None, nodes: int) -> float:
    """Host memory a node needs for CPU offload while training, 0 without offload or a shape for the model: its GPUs'
    share of what offload moves off them (ZeRO-3: bf16 weights, fp32 master weights and Adam's moments, 14 bytes a
    trained parameter, the bf16 gradient shard staying on the GPU; FSDP: parameters, gradients and Adam's moments, 16
    bytes with bf16 mixed precision's fp32 upcast; the optimizer alone: its 12 bytes, and ZeRO-2's gradient
    partition), frozen weights included."""
    if setup is None or not setup.offload or setup.strategy == "ddp":
        return 0.0
    on_gpu = sum(memory.states(setup).values())
    return (sum(memory.states(memory.with_(setup, offload=False)).values()) - on_gpu) * setup.gpus / nodes / memory.GIB


def check_host(loading: load_memory.LoadMemory, has_gib: float | None, has_from: str, offloaded: float = 0.0) -> str:
    """Host memory on the busiest node, at load and, with CPU offload, while training (`offloaded`, its share of the
    offloaded states in GiB), against `has_gib` of host memory (`has_from` says whose; None: unknown, and why): a
    line saying what was checked, or unchecked and why; an OrchError naming the fix when it does not fit."""
    load = loading.node / memory.GIB
    said = f"host memory at load: ~{load:.1f} GiB on the busiest node" + (
        f"; ~{offloaded:.1f} GiB per node while training (CPU offload)" if offloaded else "")
    need = max(load, offloaded)
    if has_gib is None:
        return f"{said}, unchecked: {has_from}"
    if need <= has_gib * HOST_USABLE_FRACTION:
        return f"{said}, fits {gib(has_gib)} GiB ({has_from})"
    floor = math.ceil(need / HOST_USABLE_FRACTION)
    what = (f"loading needs ~{load:.1f} GiB of host memory on the busiest node ({loading.path})" if load >= need else
            f"CPU offload needs ~{offloaded:.1f} GiB of host memory per node while training (the node's share "
            "of the weights and Adam's moments)")  # fmt: skip
    raise OrchError(
        f"{what}, more than {HOST_USABLE_FRACTION:.0%} of the {gib(has_gib)} GiB of {has_from}; set `memory: "
        f"{floor}+` under resources in the recipe (SkyPilot then plans a node with at least that much)"
        + (f", or {loading.fix}" if load >= need and loading.fix else "")
        + (", or more nodes (--nodes: each holds a smaller share)" if load < need else "")
    )
