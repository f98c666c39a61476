"""The network check, in every training process before the model loads: a short all-reduce over the real process
group (NCCL on GPUs, gloo on CPU), the bus bandwidth printed by the main process, and one line when it is far
below what the interconnect should give. A multi-node GPU run that silently falls back from InfiniBand/EFA to TCP
sockets is the most reported slowdown; it shows here in a few seconds instead of as a slow run.

Bus bandwidth is nccl-tests' measure: algorithm bandwidth x 2(n-1)/n for an all-reduce over n ranks, comparable
across world sizes. ORCH_NETCHECK=warn (default) | error | off; ORCH_MIN_BUS_GBPS sets the expectation (default
MULTI_NODE_GPU_GBPS for multi-node GPU runs; none otherwise, where only the figure is printed).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

import torch

from orchestrator.core.knobs import knob

MULTI_NODE_GPU_GBPS = 10.0  # TCP between 8-GPU nodes gives ~1-5 GB/s; InfiniBand/EFA 20-100+
CAUSES = (
    "usual causes: NCCL fell back to TCP sockets (no InfiniBand/EFA: check the recipe's network_tier and that the "
    "image has NCCL's net plugin; NCCL_DEBUG=INFO prints `NET/Socket`), NCCL_SOCKET_IFNAME on a slow interface, "
    "nodes in different zones or without a placement group"
)


def expectation(env: Mapping[str, str], gpus: bool, nodes: int) -> float | None:
    given = knob(env, "ORCH_MIN_BUS_GBPS")
    if given:
        return given
    return MULTI_NODE_GPU_GBPS if gpus and nodes > 1 else None


def bus_gbps(size_bytes: int, seconds: float, world: int) -> float:
    return size_bytes * 2 * (world - 1) / world / seconds / 1e9


def run(training_args, env: Mapping[str, str] = os.environ) -> float | None:
    mode = knob(env, "ORCH_NETCHECK", "warn")
    if mode == "off":
        return None
    device = training_args.device  # TrainingArguments sets up the process group here, its own way (backend, timeout)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = max(1, world // int(env.get("LOCAL_WORLD_SIZE", world)))
    gpus = device.type == "cuda"
    size = (64 if gpus else 4) * 2**20
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # connections and communicators are set up on the first one
    repeats = 5 if gpus else 3
    if gpus:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    if gpus:
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / repeats], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time: one figure, the same on every rank
    gbps = bus_gbps(size, float(elapsed.item()), world)
    want = expectation(env, gpus, nodes)
    if rank == 0:
        print(
            f"[orch] network check: all-reduce of {size >> 20} MiB over {world} ranks on {nodes} node(s) "
            f"({dist.get_backend()}): {gbps:.2f} GB/s bus bandwidth"
            + (f" (expected >= {want:g} GB/s)" if want else ""),
            flush=True,
        )
    if want and gbps < want:
        line = (
            f"network check: {gbps:.2f} GB/s bus bandwidth is below the {want:g} GB/s this run expects "
            f"(ORCH_MIN_BUS_GBPS); {CAUSES}"
        )
        if mode == "error":
            if rank == 0:
                print(f"orch: error: {line} (ORCH_NETCHECK=warn lets the run go on)", file=sys.stderr, flush=True)
            sys.exit(2)
        if rank == 0:
            print(f"[orch] warning: {line} (ORCH_NETCHECK=error makes this an error)", flush=True)
    return gbps
