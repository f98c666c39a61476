"""The emulated nodes of a local run: each one's environment, as SkyPilot gives a cluster's node, and the run's
directory that holds their homes and temporary files while they run."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from orchestrator.core import owned
from orchestrator.core.errors import OrchError
from orchestrator.core.home import SOCKET_TMPDIR, inductor_cache, own_tmp, tmp_base
from orchestrator.launch import runlock


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nothing listens on now, for the emulated nodes' rendezvous and barrier. All are held
    until every one is picked: a port taken and released at once may be the kernel's next answer too (measured: the
    barrier's port once equalled MAIN_PROCESS_PORT, which the nodes refuse). SkyPilot's own ports (knobs.NODE_PORTS,
    46590 lies in Linux's ephemeral range), which the nodes refuse too, are held and passed over."""
    from orchestrator.core.knobs import NODE_PORTS

    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            if (port := sock.getsockname()[1]) not in NODE_PORTS:
                ports.append(port)
        return ports


def threads_per_process(total_processes: int, cores: int | None = None) -> int:
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, total_processes))


def node_envs(
    task_envs: Mapping[str, str],
    nodes: int,
    procs_per_node: int,
    task_id: str,
    port: int,
    barrier_port: int,
    scratch: Path,
    launched_at: float = 0.0,
    ips: list[str] | None = None,
    iface: str = "",
) -> list[dict[str, str]]:
    """The environment of each emulated node (the caller adds os.environ). ips: each node's own address (--netns, gloo
    bound to `iface`), else every node is 127.0.0.1. scratch: the run's directory (`node_scratch`), where each node has
    its ORCH_HOME and, as a cluster's node has its own /tmp, its TMPDIR."""
    threads = threads_per_process(nodes * procs_per_node)
    node_ips = "".join(f"{ip}\n" for ip in ips) if ips else "127.0.0.1\n" * nodes
    envs = []
    for rank in range(nodes):
        env = dict(task_envs)
        env.update(
            SKYPILOT_NODE_RANK=str(rank),
            SKYPILOT_NODE_IPS=node_ips,
            SKYPILOT_NUM_NODES=str(nodes),
            SKYPILOT_NUM_GPUS_PER_NODE=str(procs_per_node),
            SKYPILOT_TASK_ID=task_id,
            ORCH_RUN_ID=task_id,
            MAIN_PROCESS_PORT=str(port),
            ORCH_BARRIER_PORT=str(barrier_port),
            ORCH_DEVICE="cpu",
            ORCH_SUMMARY="off",  # the launcher prints it once every node is done (local.py)
            OMP_NUM_THREADS=str(threads),
            ORCH_LAUNCHED_AT=f"{launched_at:.3f}",
            ORCH_VENV=sys.prefix,  # the recipe's `run:` puts ORCH_VENV/bin first on PATH, as on a node
            ORCH_HOME=str(scratch / f"node{rank}"),  # no setup ran here
            # what the node's processes leave in temporary files goes with the run (torch's elastic agent makes a
            # torchelastic_* directory at every launch and never removes it); torch.compile's cache stays shared
            TMPDIR=str(own_tmp(scratch / f"node{rank}")),
            TORCHINDUCTOR_CACHE_DIR=inductor_cache(),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_DATASETS_DISABLE_PROGRESS_BARS="1",
            PYTHONWARNINGS="ignore::FutureWarning",
            PYTHONUNBUFFERED="1",
        )
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
        envs.append(env)
    return envs


def scratch_dir(run_id: str, output_dir: Path) -> Path:
    """Named by the run and its output directory: the run id is the same for the same task in any checkout, and two
    checkouts' runs of it at once must not share (the run lock, launch/runlock.py, keeps one owner per output
    directory; the second removed the first's nodes' homes and temporary files while they ran). A node's TMPDIR lies
    in it (node<r>/tmp), and Python's multiprocessing makes AF_UNIX sockets under that (pymp-*/listener-*, 32 bytes
    more; DataLoader workers hand tensors over through them), whose paths Linux caps at 107 bytes (a 90-byte TMPDIR
    failed with "AF_UNIX path too long"). So the name shows as much of the run id as fits (RUN_IN_NAME characters at
    most), the hash the rest, and under a temporary directory too long for even that it lies in /tmp."""
    import hashlib

    name = owned.check_name(run_id, "run id")
    where = hashlib.sha256(f"{runlock.key(output_dir)} {name}".encode()).hexdigest()[:8]
    base = tmp_base(_NODE_TMP)
    shown = name[: max(0, min(RUN_IN_NAME, _room(base) - 1))].rstrip("-_.")  # and its "-"
    return base / ("orch-local-" + (f"{shown}-" if shown else "") + where)


RUN_IN_NAME = 24
# a node's TMPDIR below the run's directory's parent, the run's directory named without the id
_NODE_TMP = len(str(own_tmp(Path("/orch-local-12345678/node99"))).encode())


def _room(base: Path) -> int:
    """Characters of the run id that fit in a node's TMPDIR under `base`."""
    return SOCKET_TMPDIR - len(str(base).encode()) - _NODE_TMP


@contextlib.contextmanager
def node_scratch(run_id: str, nodes: int, output_dir: Path) -> Iterator[Path]:
    """The run's directory in this machine's temporary directory, with each node's home and TMPDIR (node<r>/tmp): made
    and marked as the run's (core/owned.py) before the nodes start, removed when they have all ended. One left by an
    attempt of the same run in the same output directory that was killed is replaced (a stale checkpoint request in a
    node's home would make the new attempt save at once); one that another run or a person made is refused, and left."""
    scratch = scratch_dir(run_id, output_dir)
    what = f"run {run_id}'s node directory"
    owned.remove(scratch, run_id, what)
    if not owned.claim(scratch, run_id):
        raise OrchError(f"{what}: {scratch} appeared while orch made it; nothing deleted")
    for rank in range(nodes):
        own_tmp(scratch / f"node{rank}").mkdir(parents=True, exist_ok=True)
    try:
        yield scratch
    finally:
        try:
            owned.remove(scratch, run_id, what)
        except (OrchError, OSError) as exc:  # never in place of the run's own outcome
            print(f"[orch] note: {what} {scratch} is left: {exc}", flush=True)
