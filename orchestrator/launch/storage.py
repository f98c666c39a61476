"""Where a run's checkpoints and final model live, read from its task: storage that outlives the cluster, or not.

A cloud node's disk disappears with the cluster: a managed job's recovery starts a new cluster, `--down` deletes
it, and a multi-node run's sharded checkpoints are split across the nodes' disks. Durable storage is a bucket
mounted (SkyPilot file_mounts with `mode: MOUNT` or `MOUNT_CACHED`) or a volume (`volumes:`) at the recipe's
CHECKPOINT_ROOT, under which the node launcher writes everything (`CHECKPOINT_ROOT/SKYPILOT_TASK_ID`).
A `COPY` mount is uploaded once at launch and never written back, so it does not count.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from orchestrator.core import mounts
from orchestrator.core.errors import OrchError

WRITABLE_MODES = ("MOUNT", "MOUNT_CACHED")
EXAMPLE = (
    "file_mounts: {/checkpoints: {name: <your bucket>, mode: MOUNT_CACHED}} and envs CHECKPOINT_ROOT: /checkpoints, "
    "as recipes/phi3_dpo_fsdp.yaml does"
)


def _under(path: str, mount: str) -> bool:
    mount = mount.rstrip("/") or "/"
    return path == mount or path.startswith(mount + "/")


def _expand(value: str, envs: Mapping[str, str]) -> str:
    """SkyPilot substitutes ${VAR} in file_mounts from the task's envs."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: str(envs.get(m.group(1) or m.group(2), m.group(0))), value)


SLURM_ROOT = "~/orch-checkpoints"
"""Where checkpoints go on a Slurm cluster: the account's home, which the nodes share (the node reads `~` as the
account's home, not SkyPilot's per-cluster $HOME there)."""


def on_slurm(task: Mapping) -> bool:
    infra = str((task.get("resources") or {}).get("infra") or "")
    return infra == "slurm" or infra.startswith("slurm/")


def slurm_task(task: Mapping, root: str = SLURM_ROOT) -> dict:
    """A recipe's task for a Slurm cluster: no object store there to mount (and `--env` cannot remove a mount), so the
    bucket mounted at CHECKPOINT_ROOT goes and CHECKPOINT_ROOT moves to the shared home (scripts/on-slurm.py prints
    it for plain `sky launch`; `orch run --infra slurm/...` applies it)."""
    envs = dict(task.get("envs") or {})
    mounted = str(envs.get("CHECKPOINT_ROOT") or "").rstrip("/")
    mounts = {k: v for k, v in (task.get("file_mounts") or {}).items() if not mounted or str(k).rstrip("/") != mounted}
    out = {k: v for k, v in task.items() if k != "file_mounts"}
    if mounts:
        out["file_mounts"] = mounts
    envs.pop("CHECKPOINT_BUCKET", None)
    envs["CHECKPOINT_ROOT"] = root
    out["envs"] = envs
    return out


def durable_checkpoints(task: Mapping) -> str | None:
    """What holds CHECKPOINT_ROOT beyond the cluster ("bucket X mounted at /checkpoints"), or None."""
    envs = {k: "" if v is None else str(v) for k, v in (task.get("envs") or {}).items()}
    root = envs.get("CHECKPOINT_ROOT", "").strip()
    if not root:
        return None
    if on_slurm(task) and (root == "~" or root.startswith(("~/", "/"))) and not root.startswith("/tmp"):
        return f"the Slurm cluster's shared file system at {root}"
    for dst, src in (task.get("file_mounts") or {}).items():
        if not _under(root, str(dst)) or not isinstance(src, Mapping):
            continue
        mode = str(src.get("mode") or "MOUNT").upper()
        name = src.get("name") or src.get("source")
        if name and mode in WRITABLE_MODES:
            return f"bucket {_expand(str(name), envs)} mounted at {dst} ({mode})"
    for dst, volume in (task.get("volumes") or {}).items():
        if _under(root, str(dst)):
            return f"volume {volume} mounted at {dst}"
    return None


def medium(task: Mapping) -> tuple[str, str]:
    """What of the checkpoints lands on a node's own disk (core/disk_need.need): "disk" (CHECKPOINT_ROOT unset or not
    durable: the output_dir is on it), "cache" (a bucket mounted MOUNT_CACHED: rclone's cache is on it) or "remote"
    (a MOUNT bucket, a volume, a Slurm cluster's shared file system); and where they go, in words."""
    where = durable_checkpoints(task)
    if where is None:
        return "disk", "the nodes' own disks"
    return ("cache" if where.endswith("(MOUNT_CACHED)") else "remote"), where


def require_durable(task: Mapping, reasons: list[str]) -> str:
    """The durable storage of a launch that needs it (managed job, several nodes, --down), else one clear error."""
    where = durable_checkpoints(task)
    if where is None:
        root = str((task.get("envs") or {}).get("CHECKPOINT_ROOT") or "").strip()
        what = f"CHECKPOINT_ROOT={root} is not a mounted bucket or volume" if root else "CHECKPOINT_ROOT is not set"
        raise OrchError(
            f"{' and '.join(reasons)} would lose the checkpoints and the final model, which stay on the nodes' disks "
            f"({what}); mount a bucket at CHECKPOINT_ROOT: {EXAMPLE}"
        )
    return where


def unsaved_recovery(settings: Mapping[str, object], managed: bool) -> list[str]:
    """A run on nodes that may be preempted (a managed job, spot) goes on from its last checkpoint; with
    save_strategy=no there is none before the final model (the nodes' cadence line says when checkpoints come)."""
    if str(settings.get("save_strategy", "steps")).strip().lower() != "no":
        return []
    lost = ("every recovery of the managed job trains again from step 0, and pays for it again" if managed else
            "a preemption of a spot node loses the whole run")  # fmt: skip
    return [f"[orch] warning: save_strategy=no saves nothing before the final model: {lost}; save_strategy=steps "
            "with save_steps=N keeps the work"]


def user_id() -> str:
    """8 hex characters for this user: SkyPilot's own user hash when it has made one, else one of user and host."""
    import getpass
    import hashlib
    import socket

    sky_hash = Path.home() / ".sky" / "user_hash"
    try:
        value = sky_hash.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{8,}", value):
            return value[:8]
    except OSError:
        pass
    return hashlib.sha256(f"{getpass.getuser()}@{socket.gethostname()}".encode()).hexdigest()[:8]


def shipped_bucket(name: str) -> bool:
    """Recipes ship placeholder bucket names (orch-<recipe>-checkpoints): bucket names are global, so two users
    of the same recipe would collide."""
    return bool(re.fullmatch(r"orch-[a-z0-9-]+-checkpoints", name))


def personal_bucket(recipe_name: str, user: str) -> str:
    """orch-<recipe>-<user id>: unique to the user and the recipe, within S3/GCS naming rules (3-63 characters)."""
    stem = re.sub(r"[^a-z0-9-]", "-", recipe_name.lower()).strip("-")
    return f"orch-{stem}"[: 63 - len(user) - 1].rstrip("-") + f"-{user}"


def check_writable(path: Path, what: str) -> None:
    """A directory orch will create and write: every name fits the file system, and the nearest existing folder
    above it takes a new folder (tried for real, then removed: permissions, read-only mounts, /proc)."""
    import errno
    import os
    import tempfile

    for part in path.parts:
        if len(part.encode()) > 255:
            raise OrchError(f"{what} {str(path)[:80]}...: a name of {len(part)} characters is too long (255 at most)")
    existing = mounts.existing(path)
    if not existing.is_dir():
        raise OrchError(f"{what} {path}: {existing} is a file, not a directory; choose another {what}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".orch-write-test-", dir=existing))
    except OSError as exc:
        reason = "read-only file system" if exc.errno == errno.EROFS else exc.strerror
        raise OrchError(f"{what} {path}: cannot write under {existing} ({reason}); choose another {what}") from None


def fetch_from_head(record, sub: str, dest: Path, rules: tuple[str, ...] = (), otherwise: str = "",
                    with_copy: str = "") -> None:  # fmt: skip
    """rsync <output_dir>/<sub> of a cluster run from its head node into dest, over the SSH alias SkyPilot writes
    for the cluster (CHECKPOINT_ROOT/<run>; a run recorded before ORCH_RUN_ID: its task id, ending with
    _<cluster>_<job id>). What the user can do
    instead: `otherwise` when there is no cluster, `with_copy` (of the output dir) when there is no CHECKPOINT_ROOT."""
    import subprocess

    cluster, job = record.get("cluster"), str(record.get("job_id"))
    if not cluster or not job.isdigit():
        raise OrchError(
            f"run {record.run} has no cluster to fetch from (a managed job's cluster is gone with the job): "
            f"{otherwise}"
        )
    root = (record.task.get("envs") or {}).get("CHECKPOINT_ROOT")
    if not root:
        raise OrchError(
            f"run {record.run} kept its output in the TRL config's output_dir on the nodes (no CHECKPOINT_ROOT): copy "
            f"that directory from cluster {cluster} (rsync -a {cluster}:~/sky_workdir/OUTPUT_DIR .){with_copy}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    run_id = (record.task.get("envs") or {}).get("ORCH_RUN_ID")  # orch's runs; older ones keyed by SkyPilot's task id
    source = f"{cluster}:{root}/{run_id}/{sub}" if run_id else f"{cluster}:{root}/*_{cluster}_{job}/{sub}"
    print(f"[orch] fetching {source} (rsync over SkyPilot's SSH alias)", flush=True)
    done = subprocess.run(["rsync", "-a", *rules, source, str(dest)], capture_output=True, text=True)
    if done.returncode != 0:
        raise OrchError(f"could not fetch {source} from cluster {cluster}: {done.stderr.strip()[-300:]}")
