"""A node's own directory for orch (ORCH_HOME, default ~/.orch), shared by the node launcher and the training
processes: setup timings, NCCL traces, Trackio's live databases, and the checkpoint request of the preemption hook;
the run id both read (run_id); and, on SkyPilot's Slurm nodes, the account's home for the caches (shared_caches)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from orchestrator.core.errors import OrchError

# `orch node --checkpoint-now` writes the request; the ranks (train/callbacks.py) save and write the done file
SAVE_REQUEST, SAVE_DONE = "checkpoint-request", "checkpoint-done"


def account_home() -> str:
    """This account's home from the password database: on SkyPilot's Slurm nodes $HOME is not it."""
    import pwd

    return pwd.getpwuid(os.getuid()).pw_dir


def shared_caches(env: Mapping[str, str]) -> dict[str, str]:
    """HF_HOME and ORCH_CACHE_DIR to set where SkyPilot gives the node a per-cluster $HOME (Slurm:
    <account home>/.sky_clusters/<cluster>, deleted with the cluster) and they are unset: the account's own caches,
    on its shared home, so that a new cluster finds the model, the smoke artifacts and the rehearsal there instead of
    downloading and building them again. Anywhere else: nothing."""
    account = account_home().rstrip("/")
    if not account or not env.get("HOME", "").startswith(account + "/.sky_clusters/"):
        return {}
    defaults = {"HF_HOME": f"{account}/.cache/huggingface", "ORCH_CACHE_DIR": f"{account}/.cache/orch"}
    return {name: value for name, value in defaults.items() if not env.get(name, "").strip()}


def orch_home(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("ORCH_HOME") or Path.home() / ".orch")


# The longest TMPDIR under which Python's multiprocessing makes its AF_UNIX sockets (pymp-*/listener-*, 32 bytes more;
# DataLoader workers hand tensors over through them) within the 107 bytes Linux allows: past it a worker fails with
# "AF_UNIX path too long" (measured: a 90-byte TMPDIR)
SOCKET_TMPDIR = 107 - len("/pymp-12345678/listener-12345678")


def tmp_base(below: int) -> Path:
    """Where to make a directory that will be the TMPDIR of processes with DataLoader workers, `below` bytes under
    the base: this process's temporary directory, or /tmp where that would pass SOCKET_TMPDIR (a long TMPDIR, such as
    a scheduler's per-job one). Where /tmp cannot be written either, the temporary directory still."""
    import tempfile

    base = Path(tempfile.gettempdir())
    if len(str(base).encode()) + below > SOCKET_TMPDIR and os.access("/tmp", os.W_OK | os.X_OK):
        return Path("/tmp")
    return base


def record_early_exit(output_dir: str | Path, rank: int, node: int, error: str, **more) -> None:
    """<output_dir>/orch/early-exit/rank<R>.json, where every node's launcher looks (node/supervise._left_early): a rank
    that left before training ended, recorded by itself (train/entry.run) or, when a signal ended it, by its node."""
    import json
    import time

    try:
        where = early_exits(output_dir)
        where.mkdir(parents=True, exist_ok=True)
        record = {"rank": rank, "node": node, **more, "error": error, "time": time.time()}
        (where / f"rank{rank}.json").write_text(json.dumps(record))
    except OSError:
        pass


def early_exits(output_dir: str | Path) -> Path:
    return Path(output_dir) / "orch" / "early-exit"


def first_early_exit(output_dir: str | Path, since: float) -> dict | None:
    """The earliest record_early_exit record written at or after `since` (an earlier attempt's are not this one's),
    or None: the rank whose leaving caused the network errors the other nodes then saw."""
    import json

    where = early_exits(output_dir)
    found = []
    for path in where.glob("rank*.json") if where.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            if isinstance(record, dict) and float(record.get("time", 0)) >= since:
                found.append(record)
        except (OSError, ValueError, TypeError):
            continue
    return min(found, key=lambda r: float(r.get("time", 0)), default=None)


def own_tmp(home: Path) -> Path:
    """The TMPDIR of a node whose ORCH_HOME is `home`, where orch made both for the run and removes them with it (a
    local run's emulated nodes, launch/backends/local_nodes.py): such a node's launch needs no temporary directory of
    its own (node/supervise.py), whose extra level would push Python's AF_UNIX socket paths under it
    (multiprocessing's pymp-*/listener-*, which DataLoader workers use to hand tensors over) past the 107 bytes Linux
    allows."""
    return home / "tmp"


def inductor_cache(env: Mapping[str, str] = os.environ) -> str:
    """torch.compile's cache directory (Triton's kernels included) as torch chooses it in this process's temporary
    directory (torch/_inductor/runtime/cache_dir_utils.py default_cache_dir), or the one `env` sets: for processes
    given a temporary directory of their own (a local run's nodes, a launch's ranks), so that the cache stays shared
    by every run, as outside orch."""
    import getpass
    import tempfile

    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return env["TORCHINDUCTOR_CACHE_DIR"]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return str(Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """orch's caches (ORCH_CACHE_DIR, default ~/.cache/orch): smoke artifacts, rehearsals, staged data, dashboards,
    recipes that passed SkyPilot's schema. Everything under it can be deleted; it is rebuilt."""
    return Path(env.get("ORCH_CACHE_DIR") or Path.home() / ".cache" / "orch")


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def run_id(env: Mapping[str, str]) -> str:
    """The run's id on the nodes, which keys its checkpoints (CHECKPOINT_ROOT/<id>): ORCH_RUN_ID (orch sets the run's
    name: the same at every relaunch of `orch run --resume RUN` and every recovery of a managed job), else SkyPilot's
    task id (a plain `sky launch`: new at every launch), else slurm-<job id> under Slurm; "" when none is known. It
    becomes a directory name: anything but letters, digits, '.', '_', '-' is refused."""
    found = ""
    for name in ("ORCH_RUN_ID", "SKYPILOT_TASK_ID"):
        if env.get(name, "").strip():
            found = env[name].strip()
            break
    else:
        if env.get("SLURM_JOB_ID", "").strip():
            found = f"slurm-{env['SLURM_JOB_ID'].strip()}"
    if found and not RUN_ID.fullmatch(found):
        raise OrchError(
            f"run id {found!r} (ORCH_RUN_ID, SKYPILOT_TASK_ID or the Slurm job id) keys a checkpoint directory: use "
            "up to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return found
