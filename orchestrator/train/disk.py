"""A node's disk against the checkpoints still to come, measured after each save (node side, every training process).

After every save each node's main process reads what the new checkpoint takes on its own disk (the files it sees
under checkpoint-N: its ranks' shards on a node-local disk, all of them on a shared one) and the space left there,
and plays the run's remaining saves forward with transformers' rotation: a checkpoint is written whole before the
oldest beyond save_total_limit is deleted, so each save needs its full size free, and without a limit every save
stays. The first time the disk would fill before the end, the node says at which save and what fixes it; when the
very next save cannot fit, every rank stops after the checkpoint just completed (a rerun resumes from it) rather
than fail inside the save: torch.save on a full disk raised `RuntimeError: basic_ios::clear: iostream error`
with a half-written checkpoint (measured on a 4 MiB tmpfs).

transformers rotates checkpoints only where it saves (`args.should_save`: world rank 0, or every node's main
process with save_on_each_node): on node-local disks the other nodes' shards were never deleted, whatever
save_total_limit said. Each other node's main process rotates its own directory the same way after the save
barrier (on a disk node 0 shares there is nothing left to delete by then).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core import mounts

UNMEASURED = 1 << 62  # the free space of a bucket streamed through FUSE: not this node's disk, never full here
SLACK = 1.01  # a later checkpoint is a little larger (trainer_state.json's log history), and logs grow meanwhile


def used_bytes(path: Path) -> int:
    """What the files under `path` take on their disk (allocated blocks; a FUSE mount that reports none: sizes)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
    return total


@dataclass(frozen=True)
class Disk:
    """One node's disk after a save: the checkpoint's size there, the space left, the checkpoints it holds."""

    size: int
    free: int
    kept: int
    limit: int | None
    where: str = ""
    """What holds the checkpoints, where it is not the disk under them: rclone's cache for a bucket mount (measured
    there), or a bucket streamed through FUSE (not measured: free is unbounded)."""

    def fills_at(self, saves: list[int]) -> int | None:
        """The first of `saves` that will not fit, rotation included (None: they all fit)."""
        free, kept = self.free, self.kept
        for step in saves:
            if free < self.size * SLACK:
                return step
            free -= self.size
            if self.limit and kept + 1 > self.limit:
                free += self.size  # the oldest goes once the new one is whole
            else:
                kept += 1
        return None


def measure(ckpt: Path, limit: int | None, mountinfo: Path = mounts.MOUNTINFO) -> Disk:
    """The disk that holds what a save writes, as the file system under the checkpoint says (core/mounts.py): a bucket
    SkyPilot mounts through rclone reports 1 PiB, while each checkpoint passes through rclone's cache on this node's
    disk, so that disk's space is what the next save needs (with what the cache holds beyond its cap, which it evicts
    once uploaded), one checkpoint at a time; another FUSE object store streams it (nothing measured)."""
    size, medium = used_bytes(ckpt), mounts.medium_of(ckpt, mountinfo)
    if medium.kind == "remote":
        where = f"the bucket {medium.fstype} streams at {medium.point}: not this node's disk"
        return Disk(size, UNMEASURED, 1, 1, where)
    if medium.kind == "cache" and medium.lands is not None:  # it evicts uploaded files only beyond its cap
        lands = medium.lands
        evictable = max(0, (used_bytes(lands) if lands.is_dir() else 0) - mounts.RCLONE_CACHE_CAP)
        return Disk(size, shutil.disk_usage(mounts.existing(lands)).free + evictable, 1, 1,
                    f"rclone's cache at {lands} for the bucket at {medium.point}")  # fmt: skip
    kept = sum(1 for p in ckpt.parent.glob("checkpoint-*") if p.is_dir())
    return Disk(size, shutil.disk_usage(ckpt).free, kept, limit if limit and limit > 0 else None)


def _on(disk: Disk) -> str:
    return "" if disk.where else " on this node's disk"


def place(ckpt: Path, disk: Disk) -> str:
    """Where the figures were read, in words, with the space left there."""
    if disk.free >= UNMEASURED:
        return disk.where
    return f"{disk.where or ckpt.parent}: {gib(disk.free)} free"


def gib(n: float) -> str:
    if n >= 1024**4:
        return f"{n / 1024**4:.2f} TiB"
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.1f} MiB"


def _fix(disk: Disk) -> str:
    """What lets the rest of the run fit: the largest save_total_limit this disk holds, else a larger disk."""
    most = int((disk.free + disk.kept * disk.size) // (disk.size * SLACK)) - 1  # a save holds limit + 1 at its peak
    limit = (f"set save_total_limit={most} (the most this disk holds: each save writes a whole checkpoint before the "
             "oldest goes), " if most >= 1 and (disk.limit is None or most < disk.limit) else "")  # fmt: skip
    return f"{limit}free space, or give the nodes a larger disk (the recipe's resources.disk_size)"


def warning(node: int, ckpt: Path, disk: Disk, saves: list[int], fills: int) -> str:
    kept = f"save_total_limit={disk.limit} keeps {disk.limit}" if disk.limit else "no save_total_limit keeps them all"
    return (f"[orch] warning: node {node}: {ckpt.name} takes {gib(disk.size)}{_on(disk)} "
            f"({place(ckpt, disk)}), {len(saves)} save(s) to come to step {saves[-1]} and {kept}: the save at step "
            f"{fills} will not fit; {_fix(disk)}; orch stops after the last save that fits, which a rerun resumes "
            "from")  # fmt: skip


def measured(node: int, ckpt: Path, disk: Disk, saves: list[int]) -> str:
    """The first save's line: what a checkpoint takes on this node's disk, and that the rest fit."""
    rest = f"; the {len(saves)} save(s) to come to step {saves[-1]} fit" if saves else ""
    return f"[orch] node {node}: {ckpt.name} takes {gib(disk.size)}{_on(disk)} ({place(ckpt, disk)}){rest}"


def stop_words(node: int, step: int, disk: Disk, saved: str) -> str:
    return (f"the save at step {step} needs ~{gib(disk.size)} on node {node}'s disk, which has {gib(disk.free)} free: "
            f"stopped after {saved}, complete, which a rerun resumes from; {_fix(disk)}")


def rotate_here(args, state) -> None:
    """transformers' own rotation (`_save_checkpoint`), on a node where it does not save: there its shards on a
    node-local disk stayed. Called after the save barrier: node 0 has rotated a disk it shares by then."""
    if args.should_save or not args.save_total_limit:
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=args.output_dir, save_total_limit=args.save_total_limit,
                       best_model_checkpoint=state.best_model_checkpoint, use_mtime=False)  # fmt: skip
