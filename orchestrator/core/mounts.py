"""Which file system holds a path, and what that means for what is written there (no torch import): SkyPilot mounts
buckets through FUSE, whose statfs says nothing of this node's disk (rclone reports 1 PiB), and a Slurm cluster's home
is a network file system every node writes to. Read from the kernel's mountinfo; used by the head node's disk check
(node/disk_room.py) and the measure after each save (train/disk.py).

    fuse.rclone                 SkyPilot's MOUNT_CACHED (and rclone MOUNT) buckets: what is written passes through
                                rclone's cache on this node's disk (~/.cache/rclone), uploaded and then evicted
    another FUSE object store   (gcsfuse, goofys, mountpoint-s3, blobfuse...): streamed, nothing kept here
    a network file system       (nfs, lustre...): shared by the nodes
    anything else               this node's own disk
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

MOUNTINFO = Path("/proc/self/mountinfo")

NETWORK = ("nfs", "nfs4", "lustre", "cifs", "smb3", "beegfs", "gpfs", "ceph", "glusterfs", "fuse.glusterfs",
           "fuse.sshfs", "9p", "virtiofs", "fuse.juicefs", "wekafs")  # fmt: skip
RCLONE_CACHE = "~/.cache/rclone"  # SkyPilot's RCLONE_CACHE_DIR (sky/skylet/constants.py)
# SkyPilot's --vfs-cache-max-size for MOUNT_CACHED (sky/data/storage.py MountCachedConfig): rclone evicts uploaded files
# only beyond it, and a write the cache's disk cannot hold fails with the file half written, and uploaded so (measured
# with rclone 1.60: a 3 MB file through a 2 MB cache reached the store as 1,040,384 bytes)
RCLONE_CACHE_CAP = 10 * 1024**3


def existing(path: Path) -> Path:
    """`path`, or its nearest folder that exists (what a path to be made will be made under)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: Path, mountinfo: Path = MOUNTINFO) -> tuple[str, str]:
    """(mount point, file system type) of the mount that holds or will hold `path` (the links of its existing part
    resolved), by the kernel's mountinfo; ("", "") where it cannot be read."""
    there = existing(path.absolute())
    target = os.path.join(os.path.realpath(there), os.path.relpath(path.absolute(), there))  # links resolved
    target = os.path.normpath(target)
    best = ("", "")
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


class Medium(NamedTuple):
    kind: str
    """core/disk_need's medium: "cache", "remote" or "disk"."""
    lands: Path | None
    """The folder whose file system holds what is written (None: not this node's)."""
    shared: bool
    """A network file system: every node writes there."""
    point: str
    fstype: str
    """The mount under the path (mount_of)."""


def medium_of(output_dir: Path, mountinfo: Path = MOUNTINFO) -> Medium:
    """What writing under `output_dir` puts on this node's disks, by the mount under it."""
    point, fstype = mount_of(output_dir, mountinfo)
    if fstype == "fuse.rclone":
        return Medium("cache", Path(os.path.expanduser(RCLONE_CACHE)), False, point, fstype)
    if fstype.startswith("fuse.") and fstype not in NETWORK:
        return Medium("remote", None, False, point, fstype)
    return Medium("disk", output_dir, fstype in NETWORK, point, fstype)
