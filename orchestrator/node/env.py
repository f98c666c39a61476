"""Node side: which node this is, read from the environment the cluster manager set.

One small pure function per environment, each returning the same record (core.topology.Topology); today
SkyPilot's. Callers pass the mapping in (never os.environ deep inside), so every decision is tested with a dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from orchestrator.core.errors import OrchError
from orchestrator.core.topology import Topology

SKYPILOT_VARS = (
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE",
)


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise OrchError(
            f"{name} is not set: `orch node` runs on a node started by SkyPilot (`sky launch` or `orch run`); "
            f"to try it by hand set {', '.join(SKYPILOT_VARS)}"
        )
    try:
        return int(raw.strip())
    except ValueError:
        raise OrchError(f"{name}={raw!r} is not a whole number; SkyPilot sets it to an integer") from None


def from_env(env: Mapping[str, str]) -> Topology:
    """Read SkyPilot's per-node variables and check that they agree with each other."""
    nodes = _int_var(env, "SKYPILOT_NUM_NODES")
    gpus = _int_var(env, "SKYPILOT_NUM_GPUS_PER_NODE")
    rank = _int_var(env, "SKYPILOT_NODE_RANK")
    if "SKYPILOT_NODE_IPS" not in env:
        _int_var(env, "SKYPILOT_NODE_IPS")  # raises the "is not set" error
    ips = tuple(line.strip() for line in env["SKYPILOT_NODE_IPS"].splitlines() if line.strip())
    for ip in ips:
        check_address(ip, "SKYPILOT_NODE_IPS")
    if nodes < 1:
        raise OrchError(f"SKYPILOT_NUM_NODES={nodes}: a cluster has at least 1 node")
    if gpus < 1:
        raise OrchError(
            f"SKYPILOT_NUM_GPUS_PER_NODE={gpus}: the task has no GPUs; "
            "set `resources.accelerators` in the recipe (e.g. A100:8) or pass --gpus to `orch run`"
        )
    if not 0 <= rank < nodes:
        raise OrchError(f"SKYPILOT_NODE_RANK={rank} is outside 0..{nodes - 1} (SKYPILOT_NUM_NODES={nodes})")
    if len(ips) != nodes:
        raise OrchError(
            f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) but SKYPILOT_NUM_NODES={nodes}; "
            "it must hold one IP per line, head node first"
        )
    return Topology(nodes=nodes, gpus_per_node=gpus, node_rank=rank, node_ips=ips)


def env_port(env: Mapping[str, str], name: str, default: int) -> str:
    """A TCP port from the env (a recipe's MAIN_PROCESS_PORT, ORCH_BARRIER_PORT, ...), default when unset."""
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise OrchError(f"{name}={raw!r} is not a TCP port (1-65535)")
    return raw


def check_address(text: str, source: str) -> str:
    """A node address: an IPv4 or IPv6 address (SkyPilot writes IPs; a host name would need DNS on every node)."""
    import ipaddress

    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise OrchError(f"{source}: {text!r} is not an IPv4 or IPv6 address (one per line, head node first)") from None
    return text.strip("[]")


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(raw)
    return value


def _count(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


def _choice(*choices: str):
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(raw)
        return raw.lower()

    return parse


def _project(raw: str) -> str:
    if raw.lower() != "off" and not re.fullmatch(r"[A-Za-z0-9_-]{1,100}", raw):
        raise ValueError(raw)
    return raw


# orch's own env knobs read on the nodes: name -> (parser, what it takes). plan() parses every one that is set, so
# the launch side (which computes every node's plan before sending anything) refuses a bad one first. (ORCH_DEVICE,
# DDP_TIMEOUT and the TRL/Accelerate variables are parsed by plan() itself.)
KNOBS = {
    "ORCH_RENDEZVOUS_TIMEOUT": (_seconds, "a number of seconds > 0"),
    "ORCH_STOP_GRACE": (_seconds, "a number of seconds > 0"),
    "ORCH_VLLM_POLL_SECONDS": (_seconds, "a number of seconds > 0"),
    "ORCH_VLLM_CLOSED_POLLS": (_count, "a whole number >= 1"),
    # the progress watchdog (node/watchdog.py) and the network check (train/netcheck.py)
    "ORCH_WATCHDOG": (_choice("on", "off"), "on or off"),
    "ORCH_STALL_FLOOR": (_seconds, "a number of seconds > 0"),
    "ORCH_STALL_FIRST": (_seconds, "a number of seconds > 0"),
    "ORCH_STALL_BUSY": (_seconds, "a number of seconds > 0"),
    "ORCH_NETCHECK": (_choice("warn", "error", "off"), "warn, error or off"),
    "ORCH_MIN_BUS_GBPS": (_seconds, "a number of GB/s > 0"),
    # the cluster's price in $/h (train/throughput.py: dollars spent and projected)
    "ORCH_PRICE_PER_HOUR": (_seconds, "a price in dollars per hour > 0"),
    "ORCH_MAX_COST": (_seconds, "a number of dollars > 0"),
    # Trackio (train/tracking.py): the project the nodes log to, or off
    "ORCH_TRACK": (_project, "off or a Trackio project name (letters, digits, _ and -, at most 100)"),
}


def knob(env: Mapping[str, str], name: str, default=None):
    """An orch env knob's parsed value (default when unset or empty), or one error naming what it takes."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    parse, takes = KNOBS[name]
    try:
        return parse(raw)
    except (ValueError, KeyError):
        raise OrchError(f"{name}={raw!r}: {name} takes {takes}") from None


def check_knobs(env: Mapping[str, str]) -> None:
    for name in KNOBS:
        knob(env, name)
    for name in ("MAIN_PROCESS_PORT", "ORCH_BARRIER_PORT", "VLLM_SERVER_PORT"):
        env_port(env, name, 1)


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
