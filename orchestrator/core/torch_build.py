"""Which torch an environment holds, read from its torch/version.py without importing torch (a node's own processes do
not import the training stack), and what a GPU node says when its torch cannot use its GPUs.

A GPU node whose torch sees no GPU does not fail by itself: accelerate and transformers make each of its processes a
CPU process training alone (distributed_type NO, a world of 1), N copies of the run writing the same checkpoints, on
paid GPUs. Measured here (torch 2.13.0+cpu, `orch node` with SkyPilot's variables for a node of 2 GPUs): both processes
trained steps 1-4 alone, and one failed at the first save renaming the other's checkpoint manifest
(FileNotFoundError). So `orch node` refuses a CPU build on a GPU node before it launches anything (node/exec.py), the
head node's setup does where nvidia-smi lists NVIDIA GPUs, and every rank checks what only torch can say (a CUDA build
the driver cannot run, fewer GPUs than processes) and that the trainer's world is the one torchrun started
(train/devices.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import NamedTuple


class Build(NamedTuple):
    version: str
    cuda: str | None  # torch.version.cuda: the CUDA it was built for, None in CPU and ROCm builds
    hip: str | None  # torch.version.hip: ROCm builds

    @property
    def cpu_only(self) -> bool:
        return not self.cuda and not self.hip

    def words(self) -> str:
        if self.cuda:
            return f"a CUDA {self.cuda} build"
        return f"a ROCm (HIP {self.hip}) build" if self.hip else "a CPU build (no CUDA, no ROCm)"


def parse(text: str) -> Build | None:
    """torch/version.py's literal assignments (`__version__`, `cuda`, `hip`), never executed; None without a version."""
    values: dict[str, object] = {}
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return None
    for node in body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and value is not None:
                try:
                    values[target.id] = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    pass  # not a literal: not one torch writes
    version = values.get("__version__")
    if not isinstance(version, str):
        return None

    def text_or_none(key: str) -> str | None:
        found = values.get(key)
        return found if isinstance(found, str) and found else None

    return Build(version, text_or_none("cuda"), text_or_none("hip"))


def installed() -> Build | None:
    """This Python's torch, or None where it has none (or its version file says nothing readable)."""
    try:
        spec = importlib.util.find_spec("torch")  # a top-level package's spec: torch itself is not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except OSError:
        return None


FIX = ("install a CUDA build of torch (ROCm's on AMD GPUs) in the environment the ranks run from "
       "(`bash scripts/node-setup.sh` installs uv.lock's on a node with NVIDIA GPUs), or set ORCH_DEVICE=cpu to run "
       "CPU processes on purpose")  # fmt: skip


def cpu_build_refusal(build: Build, processes: int, where: str = "this node") -> str:
    """The line for a CPU build of torch on a node that runs GPU processes."""
    return (f"{where}'s torch {build.version} is {build.words()}: it sees none of the GPUs, and each of the "
            f"{processes} GPU process(es) would train alone on the CPU; {FIX}")  # fmt: skip
