"""Where a process runs: how many nodes, how many GPUs on each, which node this is.

Built from SkyPilot's environment on a node (`from_env`), never from `os.environ` directly: callers pass
the mapping in, so every decision can be tested with a plain dict. (NamedTuples, not dataclasses: importing
dataclasses costs a node ~6 ms before training starts.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from orchestrator.errors import OrchError

SKYPILOT_VARS = (
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE",
)


class Topology(NamedTuple):
    """The shape of one run as seen from one node."""

    nodes: int
    """Number of machines in the cluster (SKYPILOT_NUM_NODES)."""
    gpus_per_node: int
    """Processes started on each machine: one per GPU (SKYPILOT_NUM_GPUS_PER_NODE)."""
    node_rank: int
    """This machine's rank, 0 for the head node (SKYPILOT_NODE_RANK)."""
    node_ips: tuple[str, ...]
    """IP address of every node, head first (SKYPILOT_NODE_IPS)."""

    @property
    def total_gpus(self) -> int:
        """Processes over all nodes: what `accelerate launch --num_processes` wants (not per node)."""
        return self.nodes * self.gpus_per_node

    @property
    def head_ip(self) -> str:
        return self.node_ips[0]


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise OrchError(
            f"{name} is not set: `orch node` runs on a node started by SkyPilot (`sky launch` or `orch run`); "
            f"to try it by hand set {', '.join(SKYPILOT_VARS)}"
        )
    try:
        return int(raw.strip())
    except ValueError:
        raise OrchError(f"{name}={raw!r} is not a whole number; SkyPilot sets it to an integer") from None


def from_env(env: Mapping[str, str]) -> Topology:
    """Read SkyPilot's per-node variables and check that they agree with each other."""
    nodes = _int_var(env, "SKYPILOT_NUM_NODES")
    gpus = _int_var(env, "SKYPILOT_NUM_GPUS_PER_NODE")
    rank = _int_var(env, "SKYPILOT_NODE_RANK")
    if "SKYPILOT_NODE_IPS" not in env:
        _int_var(env, "SKYPILOT_NODE_IPS")  # raises the "is not set" error
    ips = tuple(line.strip() for line in env["SKYPILOT_NODE_IPS"].splitlines() if line.strip())
    if nodes < 1:
        raise OrchError(f"SKYPILOT_NUM_NODES={nodes}: a cluster has at least 1 node")
    if gpus < 1:
        raise OrchError(
            f"SKYPILOT_NUM_GPUS_PER_NODE={gpus}: the task has no GPUs; "
            "set `resources.accelerators` in the recipe (e.g. A100:8) or pass --gpus to `orch run`"
        )
    if not 0 <= rank < nodes:
        raise OrchError(f"SKYPILOT_NODE_RANK={rank} is outside 0..{nodes - 1} (SKYPILOT_NUM_NODES={nodes})")
    if len(ips) != nodes:
        raise OrchError(
            f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) but SKYPILOT_NUM_NODES={nodes}; "
            "it must hold one IP per line, head node first"
        )
    return Topology(nodes=nodes, gpus_per_node=gpus, node_rank=rank, node_ips=ips)
