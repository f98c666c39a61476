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
    partition), frozen weights included; less what DeepSpeed offloads to NVMe instead (`nvme_gib`)."""
    return sum(_moved(setup, nodes, nvme=False).values())


def nvme_gib(setup: memory.Setup | None, nodes: int) -> float:
    """What a node's GPUs offload to NVMe (DeepSpeed's offload_param_device / offload_optimizer_device nvme,
    ZeRO-Infinity): the same states CPU offload keeps in host memory, written to the nvme_path's disk instead."""
    return sum(nvme_parts(setup, nodes).values())


def nvme_parts(setup: memory.Setup | None, nodes: int) -> dict[str, float]:
    """`nvme_gib` by what DeepSpeed swaps ("param", "optimizer"), each to its own nvme_path."""
    return _moved(setup, nodes, nvme=True)


def _moved(setup: memory.Setup | None, nodes: int, nvme: bool) -> dict[str, float]:
    """GiB per node moved off the GPUs by offload, by where it goes ("param", "optimizer"), those going to NVMe
    (`nvme`) or to host memory."""
    if setup is None or not setup.offload or setup.strategy == "ddp":
        return {}

    def held(s: memory.Setup) -> float:
        return sum(memory.states(s).values())

    whole = held(memory.with_(setup, offload=False))
    moved = {"optimizer": whole - held(memory.with_(setup, offload_weights=False))}
    moved["param"] = whole - held(setup) - moved["optimizer"]
    share = setup.gpus / nodes / memory.GIB
    return {part: gib * share for part, gib in moved.items() if (part in setup.nvme) == nvme}


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
