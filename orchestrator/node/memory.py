"""The head node's memory check, in the setup before the model downloads (`orch node --rehearse`): core/fit.py's rules
against what this node reports, not a catalog's figure: its GPUs' memory (nvidia-smi), and its host memory (MemTotal,
or the cgroup's limit where that is lower: a Slurm job's `--mem`, a container's). The launch side checks the same
rules against SkyPilot's catalog; this one also covers a plain `sky launch` with other accelerators (`--gpus L4:8`)
and a node whose memory the catalog does not know. ORCH_MEMORY_CHECK=off skips this one (the launch side then shows
its figures without refusing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from orchestrator.core import batch, eval_memory, fit, generation_memory, host_fit, vllm_fit
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.core.memory import GIB

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def host_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[float, str]:
    """(GiB, whose) of host memory this process may use: MemTotal, or the lowest memory limit of its cgroup and the
    cgroup's ancestors where one is lower (cgroup v2's memory.max, v1's memory.limit_in_bytes)."""
    total = None
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    if total is None:
        raise OrchError(f"{proc / 'meminfo'} has no MemTotal line")
    limit = cgroup_limit(proc, cgroup_root)
    if limit is not None and limit < total:
        return limit / GIB, "this node's cgroup memory limit (a Slurm job's --mem, a container's limit)"
    return total / GIB, "this node's MemTotal"


def cgroup_limit(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The lowest memory limit, in bytes, over this process's memory cgroup and its ancestors; None where none is set
    or none can be read."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2's unified hierarchy
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = base / path.lstrip("/")
        if not here.is_dir():  # a container sees its own cgroup as the mount's root
            here = base
        while True:
            try:
                raw = (here / name).read_text().strip()
            except OSError:
                raw = ""
            if raw.isdigit() and int(raw) < UNLIMITED:
                found.append(int(raw))
            if here == base:
                break
            here = here.parent
    return min(found) if found else None


def gpu_memory() -> tuple[float, str] | None:
    """(GiB, name) of this node's smallest GPU, from nvidia-smi; None where nvidia-smi is absent or says nothing."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return smallest_gpu(out)


def gpu_capability() -> tuple[int, int] | None:
    """The lowest CUDA compute capability of this node's GPUs, from nvidia-smi (`compute_cap`, in drivers since 2021):
    the rehearsal's fake CUDA reports it (tf32 needs 8.0); None where nvidia-smi is absent or does not say."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    found = []
    for line in out.splitlines():
        major, dot, minor = line.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit():
            found.append((int(major), int(minor)))
    return min(found) if found else None


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA this node's NVIDIA driver runs (`nvidia-smi -q`'s "CUDA Version", NVML's), or None where
    nvidia-smi is absent or does not say."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cuda_version(out)


def cuda_version(query: str) -> tuple[int, int] | None:
    """`CUDA Version : 12.2` in nvidia-smi -q's output -> (12, 2)."""
    found = re.search(r"^\s*CUDA Version\s*:\s*(\d+)\.(\d+)", query, re.M)
    return (int(found.group(1)), int(found.group(2))) if found else None


def smallest_gpu(query: str) -> tuple[float, str] | None:
    """nvidia-smi's `name, memory.total` lines (MiB) -> (GiB, name) of the GPU with the least memory."""
    gpus = []
    for line in query.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            gpus.append((int(mib) / 1024, name.strip()))
    return min(gpus) if gpus else None


def check(env: Mapping[str, str], trainer: str, settings: Mapping[str, object], accel: AccelerateConfig,
          nodes: int, per_node: int) -> str:  # fmt: skip
    """core/fit.py's checks for `nodes` x `per_node` training processes against this node's GPUs and host memory:
    one line saying what was checked, or an OrchError naming the fix."""
    if knob(env, "ORCH_MEMORY_CHECK", "on") == "off":
        return "memory: not checked (ORCH_MEMORY_CHECK=off)"
    try:
        return _check(env, trainer, settings, accel, nodes, per_node)
    except (TypeError, ValueError, KeyError) as exc:  # a value of the wrong type: TRL's parser refuses it next
        return f"memory: not checked (a TRL setting is not of its type: {exc!r}; the rehearsal's TRL parser says which)"


def beyond_positions(trainer: str, settings: Mapping[str, object], accel: AccelerateConfig) -> str | None:
    """core/fit.beyond_positions for the recipe's model on this node (`sky launch` without orch on the laptop)."""
    from orchestrator.node import model_config

    model = str(settings.get("model_name_or_path", ""))
    try:
        found = model_config.read(model, settings.get("model_revision"))
        setup = fit.setup_of(trainer, settings, accel, 1, found.config, found.where)
    except (OrchError, TypeError, ValueError, KeyError):  # said by the memory line and TRL's parser
        return None
    return None if setup is None else fit.beyond_positions(setup, model)


def _check(env: Mapping[str, str], trainer: str, settings: Mapping[str, object], accel: AccelerateConfig,
           nodes: int, per_node: int) -> str:  # fmt: skip
    from orchestrator.node import model_config

    try:  # a model orch does not know by name: its config.json, a small file the download fetches anyway
        found = model_config.read(str(settings.get("model_name_or_path", "")), settings.get("model_revision"))
        setup = fit.setup_of(trainer, settings, accel, nodes * per_node, found.config, found.where,
                             batch.global_batch_of(env))  # fmt: skip
    except OrchError as exc:  # a config.json the estimate cannot read: training may still load it
        return f"memory: not checked ({exc})"
    if setup is None:
        return f"memory: not checked ({fit.unestimated(settings, found.config, found.where, found.why)})"
    loading = fit.at_load(setup, per_node, accel)
    on_gpus = knob(env, "ORCH_DEVICE", "gpu") != "cpu"
    gpu = gpu_memory() if on_gpus else None
    if gpu is not None:
        capacity, name = gpu
        estimate = fit.check_gpu(setup, capacity, name)
        fit.check_gpu_at_load(loading, capacity, name, setup.needs_bf16)
        during = eval_memory.estimate(setup)
        evaluating = f", ~{during.gib:.1f} GiB evaluating" if during else ""
        if making := generation_memory.estimate(setup):
            evaluating += f", ~{making.gib:.1f} GiB generating"
        said = (f"~{estimate.gib:.1f} GiB per GPU training{vllm_fit.vllm_words(setup, capacity)}{evaluating}, "
                f"~{loading.gpu / GIB:.1f} GiB loading, fits {fit.gib(capacity)} GiB ({name})")  # fmt: skip
    else:
        said = "GPU unchecked (no nvidia-smi)" if on_gpus else "CPU processes"
    has, whose = host_memory()
    host = host_fit.check_host(loading, has, whose, host_fit.offloaded_gib(setup, nodes))
    return f"memory ({fit.label(setup)}, {nodes} x {per_node}): {said}; {host}"
