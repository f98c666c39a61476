"""Whether a GPU can run the CUDA build of torch the nodes install, by torch's own tables, snapshotted for the launch
side (core/torch_cuda.json, `make snapshots`): `torch.cuda.PYTORCH_RELEASES_CODE_CC` (the compute capabilities each
of the release's CUDA builds has kernels for, per host architecture) and `torch.cuda.DEVICE_REQUIREMENT` (which
devices each kernel runs on), plus the CUDA of uv.lock's torch (its cuda-toolkit dependency).

uv.lock's torch 2.13.0 is the CUDA 13.0 build, whose x86_64 kernels start at compute capability 7.5: a V100 (7.0)
passed every owner's check before launch, then would fail at the first kernel on the node ("no kernel image is
available for execution on the device"; PyTorch dropped Volta from its CUDA 12.8+ builds in 2.11, pytorch#172352).
torch's CUDA 12.6 build still has 7.0 kernels: an image holding it is kept by the node setup, so a launch naming an
image is left to the node, where each rank checks its own device against its torch (train/devices.py)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path

from orchestrator.core import accelerators
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob

SNAPSHOT = Path(__file__).with_name("torch_cuda.json")


@functools.cache
def table() -> dict:
    return json.loads(SNAPSHOT.read_text())


def host_of(gpu: str) -> str:
    """The host CPU architecture of the instances carrying an accelerator: GH200's Grace is ARM."""
    return "aarch64" if gpu.upper() == "GH200" else "x86_64"


def table_host(machine: str) -> str:
    """torch's table's key for a host's `platform.machine()`: aarch64, else x86_64."""
    return "aarch64" if machine == "aarch64" else "x86_64"


def runs_on(code: int, device: int) -> bool:
    """Whether kernels built for compute capability `code` (e.g. 75) run on a device of `device` (torch's rule)."""
    rule = table()["runs"].get(str(code))
    if rule is None:  # a code torch's table does not know: its own fallback, the same major and a minor at least
        return device // 10 == code // 10 and device >= code
    if "only" in rule:
        return device in rule["only"]
    return device not in rule["exclude"] and device // 10 == rule["start"] // 10 and device >= rule["start"]


def runs_any(codes: list[int], capability: tuple[int, int]) -> bool:
    """Whether kernels built for any of `codes` run on a device of `capability`."""
    return any(runs_on(code, 10 * capability[0] + capability[1]) for code in codes)


def kernels(cuda: str, host: str) -> list[int]:
    """The compute capabilities torch's CUDA `cuda` build for `host` has kernels for ([]: none in torch's table)."""
    return sorted(table()["builds"].get(cuda, {}).get(host, []))


def builds_running(capability: tuple[int, int], host: str) -> list[str]:
    """The CUDA builds of the locked torch release whose kernels run on a device of `capability`."""
    return [cuda for cuda in table()["builds"] if runs_any(kernels(cuda, host), capability)]


def runs_lock(gpu: str) -> bool:
    """The accelerator (as SkyPilot spells it) runs uv.lock's torch build; True where orch has no capability for it
    (AMD's MI300X: ROCm builds, another table)."""
    capability = accelerators.CUDA_CAPABILITY.get(gpu.upper())
    if capability is None:
        return True
    codes = kernels(table()["lock_cuda"], host_of(gpu))
    return not codes or runs_any(codes, capability)


def dotted(code: int) -> str:
    """A compute capability code as torch names it: 75 -> 7.5."""
    return f"{code // 10}.{code % 10}"


def check_gpu(gpu: str, envs: Mapping[str, str] | None = None, image: object = None) -> None:
    """Refuse (OrchError, naming the fix) an accelerator that cannot run the torch build the nodes install (uv.lock's);
    not where the launch names an image (`image`: resources.image_id), whose own torch the setup keeps and each rank
    checks. ORCH_CUDA_ARCH_CHECK=off launches it anyway."""
    if image or runs_lock(gpu) or knob(envs or {}, "ORCH_CUDA_ARCH_CHECK", "on") == "off":
        return
    snapshot, capability = table(), accelerators.CUDA_CAPABILITY[gpu.upper()]
    cuda, host = snapshot["lock_cuda"], host_of(gpu)
    codes = kernels(cuda, host)
    first: dict[tuple[int, int], str] = {}  # one accelerator per capability that runs it, the oldest first
    for name, cc in sorted(accelerators.CUDA_CAPABILITY.items(), key=lambda kv: (kv[1], kv[0])):
        if runs_lock(name):
            first.setdefault(cc, name)
    newer = list(first.values())
    others = builds_running(capability, host)
    image_fix = (f", or an image holding torch {snapshot['torch']}'s CUDA {' or '.join(others)} build (--image-id; "
                 "the node setup keeps it)") if others else ""  # fmt: skip
    raise OrchError(
        f"{gpu} (compute capability {capability[0]}.{capability[1]}) cannot run torch {snapshot['torch']}'s CUDA "
        f"{cuda} build, which the nodes install (uv.lock): its {host} kernels are for compute capability "
        f"{', '.join(dotted(c) for c in codes)} (torch's own table), so the first CUDA kernel on the nodes would fail "
        f"('no kernel image is available for execution on the device'); use a GPU of compute capability "
        f"{dotted(min(codes))} or newer ({', '.join(newer[:3])} and newer){image_fix}; "
        "ORCH_CUDA_ARCH_CHECK=off launches it anyway"
    )


def install_fix(capability: tuple[int, int], host: str, version: str) -> str:
    """How to install the same torch release's CUDA build that has kernels for `capability` (torch's index URLs, as its
    own warning words them), or to use a newer GPU where none has."""
    return pip_installs(builds_running(capability, table_host(host)), version) or "use a newer GPU"


def pip_installs(builds: list[str], version: str) -> str:
    """`pip install` of torch `version`'s CUDA `builds` from torch's index URLs (as its own warning words them)."""
    return "; ".join(f"pip install torch=={version.split('+')[0]} --index-url https://download.pytorch.org/whl/"
                     f"cu{c.replace('.', '')}" for c in builds)  # fmt: skip


def check_node(capability: tuple[int, int] | None, cuda: str | None, host: str, version: str,
               envs: Mapping[str, str] | None = None, driver: tuple[int, int] | None = None) -> None:  # fmt: skip
    """On the head node, in its setup (before the model downloads): refuse a torch CUDA build the node's driver does
    not run (`driver`: the newest CUDA it runs, nvidia-smi's; CUDA's minor version compatibility runs any 13.x on a
    driver of 13.0, none on a 12.x one: skypilot#9406, its AWS image's driver 535 and torch's cu130, where
    `torch.cuda.is_available()` is False), and GPUs of `capability` (nvidia-smi's lowest) the installed torch's
    official CUDA `cuda` build has no kernels for, by torch's release table; nothing to say without a capability, a
    CUDA build, or a build the table knows (a custom one: each rank checks its own)."""
    if not cuda or knob(envs or {}, "ORCH_CUDA_ARCH_CHECK", "on") == "off":
        return
    cuda, host = ".".join(cuda.split(".")[:2]), table_host(host)
    if driver is not None and driver[0] < int(cuda.split(".")[0]):
        runnable = [c for c in table()["builds"] if int(c.split(".")[0]) <= driver[0]]
        if capability is not None:
            runnable = [c for c in runnable if c in builds_running(capability, host)]
        instead = pip_installs(runnable, version)
        raise OrchError(
            f"this node's NVIDIA driver runs CUDA up to {driver[0]}.{driver[1]} (nvidia-smi), and its torch {version} "
            f"is a CUDA {cuda} build, which needs a driver for CUDA {cuda.split('.')[0]}: torch would see no GPU and "
            "every rank would stop; use an image with a newer driver"
            + (f", or install a build this driver runs in the ranks' environment ({instead}; an image holding one is "
               "kept by the setup)" if instead else "")
            + "; ORCH_CUDA_ARCH_CHECK=off runs it anyway"
        )
    if capability is None:
        return
    codes = kernels(cuda, host)
    if not codes or runs_any(codes, capability):
        return
    fix = install_fix(capability, host, version)
    raise OrchError(
        f"this node's GPUs (compute capability {capability[0]}.{capability[1]}) cannot run its torch {version}, a "
        f"CUDA {cuda} build with kernels for {', '.join(dotted(c) for c in codes)} (torch's own table): the first CUDA "
        f"kernel would fail; install a build that has them in the ranks' environment ({fix}), or use an image "
        "holding one; ORCH_CUDA_ARCH_CHECK=off runs it anyway"
    )
