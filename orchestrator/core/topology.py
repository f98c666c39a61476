"""Where a process runs: how many nodes, how many GPUs on each, which node this is.

The record both sides use; a node builds it from its environment (`orchestrator.node.env`). (NamedTuples, not
dataclasses: importing dataclasses costs a node ~6 ms before training starts.)
"""

from __future__ import annotations

from typing import NamedTuple


class Topology(NamedTuple):
    """The shape of one run as seen from one node."""

    nodes: int
    """Number of machines in the cluster (SKYPILOT_NUM_NODES)."""
    gpus_per_node: int
    """Processes started on each machine: one per GPU (SKYPILOT_NUM_GPUS_PER_NODE)."""
    node_rank: int
    """This machine's rank, 0 for the head node (SKYPILOT_NODE_RANK)."""
    node_ips: tuple[str, ...]
    """Address of every node, head first (SKYPILOT_NODE_IPS; Slurm's host names). A torchrun-style environment names
    the head only: the head's address then stands for every node."""
    source: str = "SkyPilot"
    """The environment it was read from (node/env.py's detectors): SkyPilot, Slurm, Kubeflow or torchrun."""
    port: int = 0
    """The rendezvous port that environment dictates (PET_MASTER_PORT, MASTER_PORT); 0: the recipe's."""

    @property
    def total_gpus(self) -> int:
        """Processes over all nodes: what `accelerate launch --num_processes` wants (not per node)."""
        return self.nodes * self.gpus_per_node

    @property
    def head_ip(self) -> str:
        return self.node_ips[0]
