"""Every training process checks, before the model loads, that it runs where it was launched to run: on a GPU node
(ORCH_DEVICE is not cpu) torch must see a GPU for each process of the node, and, once the process group is up, the
trainer's world must be the one torchrun started. Either failing, the processes would not fail by themselves: each
would train alone, on the CPU of a paid GPU node (core/torch_build.py, measured). The line quotes torch's own reason
where it has one (`torch.cuda.init()`: a driver older than the build's CUDA, no NVIDIA driver)."""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping

import torch

from orchestrator.core import cuda_arch, torch_build
from orchestrator.core.knobs import knob


def gpu_problem(env: Mapping[str, str] = os.environ) -> str | None:
    """Why this node's GPU processes cannot each have a GPU, or None (and None for CPU processes)."""
    if knob(env, "ORCH_DEVICE", "gpu") == "cpu":
        return None
    local = int(env.get("LOCAL_WORLD_SIZE") or 1)
    build = torch_build.Build(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None))
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count >= local:
            return kernel_problem(int(env.get("LOCAL_RANK") or 0), env)
        visible = env.get("CUDA_VISIBLE_DEVICES")
        return (f"{local} training processes on this node and torch sees {count} GPU(s)"
                + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                + ": each process needs a GPU of its own; the node's process count (SKYPILOT_NUM_GPUS_PER_NODE, or "
                "ORCH_GPUS_PER_NODE) must not exceed the GPUs torch sees")  # fmt: skip
    if build.cpu_only:
        return torch_build.cpu_build_refusal(build, local)
    try:
        torch.cuda.init()  # raises with torch's reason: a driver too old for the build, no NVIDIA driver, ...
        said = "torch.cuda.is_available() is False"
    except Exception as exc:  # noqa: BLE001 - any reason torch gives is the one to quote
        said = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    return (f"torch {build.version} ({build.words()}) sees no GPU on this node ({said}), and each of the {local} GPU "
            "process(es) would train alone on the CPU; the node's driver and GPUs must run that build (nvidia-smi "
            "there names the driver and the newest CUDA it runs), or set ORCH_DEVICE=cpu to run CPU processes on "
            "purpose")  # fmt: skip


def kernel_problem(index: int, env: Mapping[str, str] = os.environ) -> str | None:
    """Whether torch's build has kernels for this process's GPU, by torch's own rule (the check torch only warns
    about at its CUDA initialisation; the first kernel then fails with "no kernel image is available")."""
    if torch.version.cuda is None or knob(env, "ORCH_CUDA_ARCH_CHECK", "on") == "off":
        return None  # ROCm builds: torch checks nothing of the kind either
    codes = [int(m.group(1)) for arch in torch.cuda.get_arch_list() if (m := re.fullmatch(r"sm_(\d+)\w*", arch))]
    if not codes:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    if cuda_arch.runs_any(codes, (major, minor)):
        return None
    name = torch.cuda.get_device_name(index)
    fix = cuda_arch.install_fix((major, minor), platform.machine(), torch.__version__)
    return (f"GPU {index} ({name}, compute capability {major}.{minor}) has no kernels in torch {torch.__version__} "
            f"(a CUDA {torch.version.cuda} build for {', '.join(cuda_arch.dotted(c) for c in sorted(codes))}): its "
            f"first CUDA kernel would fail; install a build that has them in the ranks' environment ({fix}), or use "
            "an image holding one; ORCH_CUDA_ARCH_CHECK=off runs it anyway")  # fmt: skip


def world_problem(training_args, env: Mapping[str, str] = os.environ) -> str | None:
    """Whether the trainer's world (TrainingArguments', once its process group is set up) is torchrun's."""
    started = (env.get("WORLD_SIZE") or "").strip()
    if not started.isdigit():
        return None  # not started by torchrun: nothing to compare with
    device = training_args.device  # sets up the process group, TrainingArguments' own way, where nothing did yet
    made = training_args.world_size
    if made == int(started):
        return None
    state = getattr(training_args, "distributed_state", None)
    kind = getattr(getattr(state, "distributed_type", None), "value", "unknown")
    return (f"torchrun started {started} processes and the trainer made a world of {made} (accelerate's "
            f"distributed type {kind}, device {device}): each process would train alone and write the "
            "same checkpoints")  # fmt: skip


def refuse(problem: str | None) -> None:
    """Print a problem as every rank's `orch: error:` line (the node quotes the first) and end this process."""
    if problem is None:
        return
    print(f"orch: error: {problem}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
