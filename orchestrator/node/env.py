"""Node side: which node this is, read from the environment the cluster manager set.

One small pure function per environment, each returning the same record (core.topology.Topology): SkyPilot, Slurm
(srun), Kubeflow's PyTorchJob and torchrun-style variables, chosen by detect() in that order. Callers pass the mapping
in (never os.environ deep inside), so every decision is tested with a dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from orchestrator.core.errors import OrchError
from orchestrator.core.home import run_id  # noqa: F401 - the node's run id, read here with its topology
from orchestrator.core.knobs import env_port
from orchestrator.core.topology import Topology

SKYPILOT_VARS = (
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE",
)
DETECTED_IN = (
    "SkyPilot (SKYPILOT_NODE_RANK...), Slurm (srun: SLURM_JOB_ID, SLURM_NODEID...), Kubeflow's PyTorchJob "
    "(PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR...) or a torchrun-style launcher (MASTER_ADDR, NODE_RANK, NNODES)"
)
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def _int_var(env: Mapping[str, str], name: str, who: str = "SkyPilot") -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        hint = (
            f"`orch node` runs on a node started by SkyPilot (`sky launch` or `orch run`); to try it by hand set "
            f"{', '.join(SKYPILOT_VARS)}"
            if who == "SkyPilot"
            else f"{who} sets it on every node; `orch node` reads it there"
        )
        raise OrchError(f"{name} is not set: {hint}")
    try:
        return int(raw.strip())
    except ValueError:
        raise OrchError(f"{name}={raw!r} is not a whole number; {who} sets it to an integer") from None


def _checked(nodes: int, gpus: int, rank: int, addresses: tuple[str, ...], names: dict[str, str], **more) -> Topology:
    """The checks every environment gets, with that environment's variable names in the errors."""
    if nodes < 1:
        raise OrchError(f"{names['nodes']}={nodes}: a cluster has at least 1 node")
    if gpus < 1:
        raise OrchError(
            f"{names['gpus']}={gpus}: the task has no GPUs; "
            + (
                "set `resources.accelerators` in the recipe (e.g. A100:8) or pass --gpus to `orch run`"
                if names["gpus"].startswith("SKYPILOT")
                else "ask for GPUs (Slurm: --gpus-per-node) or set ORCH_GPUS_PER_NODE"
            )
        )
    if not 0 <= rank < nodes:
        raise OrchError(f"{names['rank']}={rank} is outside 0..{nodes - 1} ({names['nodes']}={nodes})")
    if len(addresses) != nodes:
        raise OrchError(
            f"{names['ips']} lists {len(addresses)} address(es) but {names['nodes']}={nodes}; "
            + ("it must hold one IP per line, head node first" if names["ips"].startswith("SKYPILOT") else
               "it must name every node of the job")  # fmt: skip
        )
    return Topology(nodes=nodes, gpus_per_node=gpus, node_rank=rank, node_ips=addresses, **more)


def _host(text: str, source: str) -> str:
    """A head or node address from a scheduler: an IP address or a host name the cluster resolves."""
    text = text.strip()
    if _HOST.match(text):
        return text
    return check_address(text, source)


def _gpus_here(env: Mapping[str, str], *names: str) -> tuple[int, str]:
    """GPUs on this node: ORCH_GPUS_PER_NODE, then the environment's own variables, then CUDA_VISIBLE_DEVICES."""
    for name in ("ORCH_GPUS_PER_NODE", *names):
        if env.get(name, "").strip():
            return _int_var(env, name), name
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible not in ("-1", "NoDevFiles"):
        return len([d for d in visible.split(",") if d.strip()]), "CUDA_VISIBLE_DEVICES"
    raise OrchError(
        f"this node's GPU count is unknown: set ORCH_GPUS_PER_NODE (or {' / '.join(names) or 'CUDA_VISIBLE_DEVICES'})"
    )


def skypilot(env: Mapping[str, str]) -> Topology:
    """SkyPilot's per-node variables, checked against each other."""
    nodes = _int_var(env, "SKYPILOT_NUM_NODES")
    gpus = _int_var(env, "SKYPILOT_NUM_GPUS_PER_NODE")
    if env.get("ORCH_GPUS_PER_NODE", "").strip():  # processes per node, when they are not GPUs (a CPU cluster)
        gpus = _int_var(env, "ORCH_GPUS_PER_NODE")
    elif gpus == 0 and env.get("ORCH_DEVICE", "").strip().lower() == "cpu":
        gpus = 1  # SkyPilot says 0 GPUs on a CPU node (`--gpus none`): one CPU process there
    rank = _int_var(env, "SKYPILOT_NODE_RANK")
    if "SKYPILOT_NODE_IPS" not in env:
        _int_var(env, "SKYPILOT_NODE_IPS")  # raises the "is not set" error
    ips = tuple(line.strip() for line in env["SKYPILOT_NODE_IPS"].splitlines() if line.strip())
    for ip in ips:
        check_address(ip, "SKYPILOT_NODE_IPS")
    names = {"nodes": "SKYPILOT_NUM_NODES", "gpus": "SKYPILOT_NUM_GPUS_PER_NODE", "rank": "SKYPILOT_NODE_RANK",
             "ips": "SKYPILOT_NODE_IPS"}  # fmt: skip
    return _checked(nodes, gpus, rank, ips, names)


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Slurm's own expansion of a host list (`scontrol show hostnames`), for lists with ranges."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OrchError(f"SLURM_JOB_NODELIST={nodelist!r}: `scontrol show hostnames` could not run ({exc})") from None
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OrchError(f"SLURM_JOB_NODELIST={nodelist!r}: `scontrol show hostnames` failed: {error}")
    return done.stdout.split()


def slurm(env: Mapping[str, str], expand=scontrol_hostnames) -> Topology:
    """srun's variables: the job's nodes (SLURM_JOB_NODELIST, expanded by Slurm's scontrol when it holds ranges),
    this node's SLURM_NODEID, SLURM_JOB_NUM_NODES, GPUs from SLURM_GPUS_ON_NODE (or the devices visible)."""
    nodes_var = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES", "").strip() else "SLURM_NNODES"
    nodes = _int_var(env, nodes_var, "Slurm")
    rank = _int_var(env, "SLURM_NODEID", "Slurm")
    list_var = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST", "").strip() else "SLURM_NODELIST"
    nodelist = env.get(list_var, "").strip()
    if not nodelist:
        raise OrchError("SLURM_JOB_NODELIST is not set: Slurm sets it in every job; `orch node` reads it under srun")
    hosts = expand(nodelist) if "[" in nodelist else [h for h in nodelist.split(",") if h.strip()]
    gpus, gpus_var = _gpus_here(env, "SLURM_GPUS_ON_NODE")
    names = {"nodes": nodes_var, "gpus": gpus_var, "rank": "SLURM_NODEID", "ips": list_var}
    return _checked(nodes, gpus, rank, tuple(_host(h, list_var) for h in hosts), names, source="Slurm")


def torchrun_style(env: Mapping[str, str]) -> Topology:
    """Kubeflow's PyTorchJob (PET_* for torchrun) or a plain MASTER_ADDR / NODE_RANK / NNODES environment: the head's
    address and port are given, the other nodes' are not (the head's stands for them)."""
    kubeflow = any(name.startswith("PET_") for name in env)
    prefix, source = ("PET_", "Kubeflow") if kubeflow else ("", "torchrun")
    nodes_raw = env.get(f"{prefix}NNODES", "").strip()
    if ":" in nodes_raw:
        raise OrchError(
            f"{prefix}NNODES={nodes_raw!r} is an elastic range: orch runs a fixed number of nodes; give one number"
        )
    nodes = _int_var(env, f"{prefix}NNODES", source)
    rank = _int_var(env, f"{prefix}NODE_RANK", source)
    head = env.get(f"{prefix}MASTER_ADDR", "").strip()
    if not head:
        raise OrchError(f"{prefix}MASTER_ADDR is not set: every node needs the head node's address from {source}")
    port = int(env_port(env, f"{prefix}MASTER_PORT", 29500))
    per_node = env.get(f"{prefix}NPROC_PER_NODE", "").strip()
    gpus, gpus_var = _gpus_here(env, *((f"{prefix}NPROC_PER_NODE",) if per_node.isdigit() else ()))
    names = {"nodes": f"{prefix}NNODES", "gpus": gpus_var, "rank": f"{prefix}NODE_RANK", "ips": f"{prefix}MASTER_ADDR"}
    address = _host(head, f"{prefix}MASTER_ADDR")
    return _checked(nodes, gpus, rank, (address,) * max(nodes, 1), names, source=source, port=port)


def detect(env: Mapping[str, str]) -> str:
    """Which environment `orch node` runs in, in this order: SkyPilot first (SkyPilot on Slurm or Kubernetes may also
    set SLURM_* or MASTER_ADDR), then Slurm, then Kubeflow / torchrun-style variables."""
    if any(name in env for name in SKYPILOT_VARS):
        return "SkyPilot"
    if env.get("SLURM_JOB_ID") and "SLURM_NODEID" in env:
        return "Slurm"
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return "Kubeflow"
    if "MASTER_ADDR" in env and ("NODE_RANK" in env or "NNODES" in env):
        return "torchrun"
    raise OrchError(
        f"no cluster environment here: `orch node` runs where {DETECTED_IN} set the node's rank; to try it by hand "
        f"set {', '.join(SKYPILOT_VARS)}"
    )


def from_env(env: Mapping[str, str]) -> Topology:
    """This node's topology, read by the detector for the environment it runs in."""
    source = detect(env)
    if source == "SkyPilot":
        return skypilot(env)
    if source == "Slurm":
        return slurm(env)
    return torchrun_style(env)


def check_address(text: str, source: str) -> str:
    """A node address: an IPv4 or IPv6 address (SkyPilot writes IPs; a host name would need DNS on every node)."""
    import ipaddress

    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise OrchError(f"{source}: {text!r} is not an IPv4 or IPv6 address (one per line, head node first)") from None
    return text.strip("[]")


SETUP_VARS = ("SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_SETUP_NODE_IPS", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE")


def run_env(env: Mapping[str, str]) -> dict[str, str]:
    """The node's variables as `run:` sees them, also from within `setup:`, where SkyPilot names them
    SKYPILOT_SETUP_NODE_RANK / _NODE_IPS / _NUM_GPUS_PER_NODE and sets no node count or task id."""
    out = dict(env)
    if "SKYPILOT_NODE_RANK" not in env and "SKYPILOT_SETUP_NODE_RANK" in env:
        ips = [line for line in env.get("SKYPILOT_SETUP_NODE_IPS", "").splitlines() if line.strip()]
        out.update(
            SKYPILOT_NODE_RANK=env["SKYPILOT_SETUP_NODE_RANK"],
            SKYPILOT_NODE_IPS=env.get("SKYPILOT_SETUP_NODE_IPS", ""),
            SKYPILOT_NUM_NODES=str(len(ips)),
            SKYPILOT_NUM_GPUS_PER_NODE=env.get("SKYPILOT_SETUP_NUM_GPUS_PER_NODE", ""),
        )
        out.setdefault("SKYPILOT_TASK_ID", "setup")
    return out


def with_recipe(path: str, env: Mapping[str, str]) -> dict[str, str]:
    """`orch node --recipe FILE`, where no SkyPilot passes the task's envs (Slurm, an operator, by hand): the recipe's
    `envs:` under this environment's variables (which win, as `--env` does)."""
    from pathlib import Path

    from orchestrator.core import files

    task = files.load_yaml(Path(path), "--recipe") or {}
    envs = task.get("envs") if isinstance(task, dict) else None
    if not isinstance(envs, dict) or "TRL_TRAINER" not in envs:
        raise OrchError(f"--recipe {path}: not an orch recipe (its `envs:` name no TRL_TRAINER); see `orch ls`")
    return {**{str(k): "" if v is None else str(v) for k, v in envs.items()}, **env}
