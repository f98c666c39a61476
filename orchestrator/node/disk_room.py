"""The head node's disks against core/disk_need's figures, in its setup, beside the model's download (node side).

`orch run` checks a cloud launch against the task's disk_size before anything is provisioned
(launch/preflight.check_disk). Plain `sky launch`, a Slurm or Kubernetes cluster (no disk_size to read) and an image
that keeps more than the launch side can know get the same check here, against what this node's file systems report:
the model's download (what the Hugging Face cache does not hold yet) where the cache lies, and node 0's checkpoints
where the file system under the output_dir puts them (core/mounts.py): a SkyPilot bucket mounted through rclone (its
statfs says 1 PiB) passes them through rclone's cache on this node's disk, one at a time; another FUSE object store
keeps nothing here; a network file system (a Slurm cluster's shared home) gets every node's share, save_total_limit +
1 of them at once, and the final model; this node's own disk its share the same way.

Measured back to back (the download is running): the cache's bytes for the model so far, then the free space.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.core import disk_need, fit, host_fit, mounts
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.core.final_model import size_words
from orchestrator.core.knobs import knob
from orchestrator.core.memory import GIB


def hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub puts the model on this node (HF_HUB_CACHE, HF_HOME/hub; core/home.shared_caches on
    Slurm), as train/prefetch.py downloads it."""
    from orchestrator.core.home import shared_caches

    env = {**env, **shared_caches(env)}
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(env["HF_HUB_CACHE"]))
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def _held(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # renamed under the walk (an .incomplete file done)
                continue
    return total


def check(env: Mapping[str, str], trainer: str, settings: Mapping[str, object], accel: AccelerateConfig,
          argv: Sequence[str], nodes: int, per_node: int) -> str:  # fmt: skip
    """One line saying what was checked, or an OrchError naming the file system, the figures and the fixes."""
    from orchestrator.node import model_config
    from orchestrator.node.script import output_dir_in

    if knob(env, "ORCH_DISK_CHECK", "on") == "off":
        return "disk: not checked (ORCH_DISK_CHECK=off)"
    model = str(settings.get("model_name_or_path", ""))
    try:
        found = model_config.read(model, settings.get("model_revision"))
        setup = fit.setup_of(trainer, settings, accel, nodes * per_node, found.config, found.where)
    except (OrchError, TypeError, ValueError, KeyError):  # the memory line and TRL's parser say what it is
        return "disk: not checked (the model's shape is not known here)"
    if setup is None:
        return "disk: not checked (the model's shape is not known here)"
    output_dir = Path(output_dir_in(argv) or str(settings.get("output_dir") or "outputs"))
    medium = mounts.medium_of(output_dir)
    need: dict[Path, list[tuple[str, float]]] = {}
    if not model_config.is_path(model):
        cache = hub_cache(env)
        held = _held(cache / f"models--{model.replace('/', '--')}")
        remaining = max(0.0, setup.arch.params * disk_need.stored_bytes(found.config) - held)
        need.setdefault(cache, []).append((f"the model's download {size_words(remaining)} still to come", remaining))
    if medium.lands is not None:  # node 0's checkpoints (every node's on a shared file system) and the final model
        got = disk_need.need(setup, nodes, accel, settings, medium=medium.kind, where="", shared=medium.shared,
                             disk_gb=disk_need.DEFAULT_DISK_GB, download_bytes=None)  # fmt: skip
        whose = (" (every node's share: a shared file system)" if medium.shared and nodes > 1 else
                 " (node 0's share)" if nodes > 1 and got.ckpt.layout.startswith("every rank") else "")  # fmt: skip
        parts = need.setdefault(medium.lands, [])
        if medium.kind == "cache":  # the larger of the two passes through rclone's cache at once
            parts.append((f"a checkpoint {size_words(got.checkpoints)}{whose} in rclone's cache", got.checkpoints))
        else:
            many = f"{got.kept} checkpoints" if got.kept > 1 else "a checkpoint"
            parts += [(f"{many} {size_words(got.checkpoints)}{whose}", got.checkpoints),
                      (f"the final model {size_words(got.final)}", got.final)]  # fmt: skip
            if there := _held(output_dir):  # a relaunch: its checkpoints are among those, and already on the disk
                parts.append((f"less {size_words(there)} the output_dir holds already", -float(there)))
    swapped = host_fit.nvme_parts(setup, nodes)
    for part, gib in swapped.items():  # DeepSpeed's swap files (ZeRO-Infinity)
        path = Path(accel.nvme_paths[part])
        if not path.is_dir():
            raise OrchError(f"offload_{part}_nvme_path {path} is not a directory on this node: DeepSpeed would make "
                            f"it on {mounts.mount_of(path)[0] or '/'} and swap there; "
                            "mount the nodes' NVMe there in the recipe's setup, or give the path where it is mounted")
        need.setdefault(path, []).append((f"DeepSpeed's {part} swap files {size_words(gib * GIB)} (offload to nvme)",
                                          gib * GIB))  # fmt: skip
    fixes = ("give the nodes larger disks (resources.disk_size; `orch run --disk-size`): rclone's cache holds each "
             "checkpoint whole there before the upload" if medium.kind == "cache" else
             "give the nodes larger disks (resources.disk_size; `orch run --disk-size`), keep fewer checkpoints "
             "(save_total_limit=1) or put them on a bucket (CHECKPOINT_ROOT on a MOUNT_CACHED mount, as the recipes "
             "do)")  # fmt: skip
    if swapped:
        fixes += ("; for DeepSpeed's swap files, a larger NVMe at the nvme_path, more nodes (each swaps its share) or "
                  "offload to cpu")  # fmt: skip
    return _judge(need, fixes)


def _judge(need: dict[Path, list[tuple[str, float]]], fixes: str) -> str:
    """Each file system's parts against its free space: the line, or an OrchError for the first that cannot hold
    them. Folders on one file system are summed."""
    by_device: dict[int, tuple[Path, list[tuple[str, float]]]] = {}
    for folder, parts in need.items():
        existing = mounts.existing(folder.absolute())
        device = existing.stat().st_dev
        by_device.setdefault(device, (Path(mounts.mount_of(existing)[0] or existing), []))[1].extend(parts)
    said = []
    for where, parts in by_device.values():
        total = sum(n for _, n in parts)
        free = shutil.disk_usage(where).free
        words = "; ".join(text for text, _ in parts)
        if total > free:
            raise OrchError(
                f"this node's disk at {where} has {size_words(free)} free and this run needs ~{size_words(total)} "
                f"there ({words}): {fixes}; ORCH_DISK_CHECK=off launches it anyway"
            )
        said.append(f"~{size_words(total)} of {size_words(free)} free at {where} ({words})")
    return "disk: " + ("; ".join(said) if said else "nothing of this run lands on this node's disks")
