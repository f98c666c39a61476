"""orch's own collectives inside the training processes (every rank calls each one), and where a rank runs."""

from __future__ import annotations

import os

import torch


def node_of_process() -> tuple[int, int]:
    """(this node's rank, the number of nodes), as torchrun set them for the training process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return int(os.environ.get("GROUP_RANK", "0")), max(1, world // max(1, local))


def dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def collective_device(backend: str) -> str:
    """Where a tensor for one of orch's own collectives lives: NCCL takes only GPU tensors, gloo only CPU ones."""
    return "cuda" if "nccl" in backend else "cpu"


def for_collective(values: list, dtype: torch.dtype) -> torch.Tensor:
    where = collective_device(str(dist().get_backend())) if dist() else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if where == "cuda" else torch.device("cpu")
    return torch.tensor(values, dtype=dtype, device=device)


def min_over_ranks(value: int) -> int:
    """The smallest `value` over all ranks (a collective: every rank calls it); `value` itself without a group."""
    if not dist():
        return value
    tensor = for_collective([value], torch.long)
    dist().all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())


def max_over_ranks(value: int) -> int:
    return -min_over_ranks(-value)


def gather_rows(row: list[float]) -> list[list[float]]:
    """Every rank's `row` (the same length on each), in rank order; [row] without a group. float64 keeps integers
    below 2**53 exact (byte counts)."""
    if not dist():
        return [row]
    tensor = for_collective(row, torch.float64)
    rows = [torch.zeros_like(tensor) for _ in range(dist().get_world_size())]
    dist().all_gather(rows, tensor)
    return [r.tolist() for r in rows]
