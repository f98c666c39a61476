"""The head node's disk check in its setup (node/disk_room.py): plain `sky launch`, Slurm and Kubernetes get what
`orch run` checks against disk_size (tests/test_disk_need.py), from this node's own file systems."""

import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.core import mounts
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.node import disk_room

QWEN = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "save_total_limit": 2, "dtype": "bfloat16"}  # 494M
DDP = AccelerateConfig.of({"distributed_type": "MULTI_GPU"})
FSDP2 = AccelerateConfig.of({"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2}})


def mountinfo(tmp_path: Path, *mounts: tuple[str, str]) -> Path:
    """A /proc/self/mountinfo holding these (mount point, file system type) lines, as the kernel writes them."""
    lines = [f"{20 + i} 1 0:{i} / {point} rw,relatime shared:{i} - {fstype} src rw" for i, (point, fstype) in
             enumerate([("/", "ext4"), *mounts])]  # fmt: skip
    path = tmp_path / "mountinfo"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.unit
@pytest.mark.parametrize("fstype, medium, shared", [
    ("fuse.rclone", "cache", False),  # SkyPilot's MOUNT_CACHED (statfs: 1 PiB): its cache on the node's disk
    ("fuse.gcsfuse", "remote", False), ("fuse.goofys", "remote", False),  # MOUNT: streamed
    ("nfs4", "disk", True), ("lustre", "disk", True),  # a Slurm cluster's shared home: every node's share
    ("xfs", "disk", False),
])  # fmt: skip
def test_where_checkpoints_land_is_read_from_the_file_system_under_the_output_dir(tmp_path, fstype, medium, shared):
    info = mountinfo(tmp_path, ("/checkpoints", fstype), ("/checkpoints/deeper/x", "ext4"))
    got, lands, is_shared, point, _ = mounts.medium_of(Path("/checkpoints/run-1"), info)
    assert point == "/checkpoints"
    assert (got, is_shared) == (medium, shared)
    assert lands == {"cache": Path(os.path.expanduser("~/.cache/rclone")), "remote": None}.get(
        medium, Path("/checkpoints/run-1"))  # fmt: skip
    assert mounts.mount_of(Path("/checkpoints/deeper/x/y"), info) == ("/checkpoints/deeper/x", "ext4")
    assert mounts.mount_of(Path("/elsewhere"), info) == ("/", "ext4")


@pytest.mark.unit
def test_the_check_is_off_with_its_knob_and_quiet_about_a_model_of_unknown_shape(tmp_path):
    off = disk_room.check({"ORCH_DISK_CHECK": "off"}, "sft", QWEN, DDP, [], 1, 4)
    assert off == "disk: not checked (ORCH_DISK_CHECK=off)"
    unknown = {"model_name_or_path": str(tmp_path)}  # a folder with no config.json
    assert disk_room.check({}, "sft", unknown, DDP, [], 1, 4) == \
        "disk: not checked (the model's shape is not known here)"  # fmt: skip


@pytest.mark.root  # a tmpfs mounted
@pytest.mark.unit
def test_a_disk_too_small_for_the_download_and_checkpoints_stops_the_setup(tmp_path):
    """The cache and the output_dir on one 64 MiB tmpfs: Qwen2.5-0.5B's ~1 GB download alone does not fit, refused
    naming the mount, its free space and each part. On a 64 GiB one (a size limit, not memory) it fits and the line
    says so; what the cache already holds of the model is not counted again (a sparse blob of 0.5 GB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {"HF_HUB_CACHE": str(disk / "hub"), "HOME": str(tmp_path)}
    argv = ["--output_dir", str(disk / "run")]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(OrchError) as refused:
            disk_room.check(env, "sft", QWEN, DDP, argv, 1, 4)
        said = str(refused.value)
        assert said.startswith(f"this node's disk at {disk} has 67.1 MB free and this run needs ~") and \
            "the model's download 1.0 GB still to come; 3 checkpoints 8.9 GB; the final model 1.0 GB" in said and \
            "the final model 1.0 GB" in said and "ORCH_DISK_CHECK=off launches it anyway" in said, said  # fmt: skip
        subprocess.run(["mount", "-o", "remount,size=64G", str(disk)], check=True)
        line = disk_room.check(env, "sft", QWEN, DDP, argv, 1, 4)
        assert line.startswith("disk: ~") and f"free at {disk} (the model's download 1.0 GB still to come" in line
        blobs = disk / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "blobs"
        blobs.mkdir(parents=True)
        with open(blobs / "abc.incomplete", "wb") as fh:
            fh.truncate(500_000_000)
        assert "the model's download 488.0 MB still to come" in disk_room.check(env, "sft", QWEN, DDP, argv, 1, 4)
        (disk / "run" / "checkpoint-4").mkdir(parents=True)  # a relaunch: what its output_dir holds is counted once
        with open(disk / "run" / "checkpoint-4" / "optimizer.pt", "wb") as fh:
            fh.truncate(2_000_000_000)
        again = disk_room.check(env, "sft", QWEN, DDP, argv, 1, 4)
        assert again.startswith("disk: ~8.4 GB of ") and "; less 2.0 GB the output_dir holds already)" in again, again
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
