"""orch's own environment knobs, parsed in one place by every process that reads one: the launch side (which
computes every node's plan before anything is sent, so a bad value is refused there first), the node launcher, the
guards, and the training ranks. Each knob: a parser and what it takes, for the one error line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from orchestrator.core.errors import OrchError, closest


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


def _switch(raw: str) -> str:
    """on/off, with the spellings people use for them."""
    value = raw.lower()
    if value in ("on", "true", "yes", "1"):
        return "on"
    if value in ("off", "false", "no", "0"):
        return "off"
    raise ValueError(raw)


def _time(raw: str) -> float:
    """A Unix time (seconds since 1970), as `time.time()` writes it."""
    value = float(raw)
    if not 0 < value < 1e11:
        raise ValueError(raw)
    return value


def _prices(raw: str) -> dict[str, float]:
    """{"<cloud>/<region>": $/h of the whole cluster} (launch/placement.price_table writes it)."""
    import json

    table = json.loads(raw)
    if not isinstance(table, dict):
        raise ValueError(raw)
    return {str(where): _seconds(str(price)) for where, price in table.items()}


def _repo_id(raw: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", raw) or "--" in raw or ".." in raw:
        raise ValueError(raw)
    return raw


SECONDS = (_seconds, "a number of seconds > 0")
ON_OFF = (_switch, "on or off")

# name -> (parser, what it takes). node/plan.plan() parses every one that is set, so the launch side refuses a bad
# one first. (DDP_TIMEOUT and the TRL/Accelerate variables are parsed by plan() itself.)
KNOBS = {
    "ORCH_RENDEZVOUS_TIMEOUT": SECONDS,
    "ORCH_STOP_GRACE": SECONDS,
    # how long the other nodes may take to exit once one node finished its training cleanly (local backend)
    "ORCH_NODE_EXIT_WAIT": SECONDS,
    "ORCH_VLLM_POLL_SECONDS": SECONDS,
    "ORCH_VLLM_CLOSED_POLLS": (_count, "a whole number >= 1"),
    # the progress watchdog (node/watchdog.py) and the network check (train/netcheck.py)
    "ORCH_WATCHDOG": (_choice("on", "off"), "on or off"),
    "ORCH_STALL_FLOOR": SECONDS,
    "ORCH_STALL_FIRST": SECONDS,
    "ORCH_STALL_BUSY": SECONDS,
    "ORCH_NETCHECK": (_choice("warn", "error", "off"), "warn, error or off"),
    # retryable failures in a row with no step trained beyond the node's best before it gives up (node/retries.py)
    "ORCH_STUCK_RETRIES": (_count, "a whole number >= 1"),
    # training whose gradients or loss stop being finite (train/divergence.py): stop there, or say so and go on
    "ORCH_NONFINITE": (_choice("stop", "warn"), "stop or warn"),
    "ORCH_MIN_BUS_GBPS": (_seconds, "a number of GB/s > 0"),
    # the cluster's price in $/h (train/throughput.py: dollars spent and projected)
    "ORCH_PRICE_PER_HOUR": (_seconds, "a price in dollars per hour > 0"),
    "ORCH_MAX_COST": (_seconds, "a number of dollars > 0"),
    # a checkpoint on request (`orch node --checkpoint-now`, the preemption hook of spot and managed launches)
    "ORCH_SAVE_ON_REQUEST": (_choice("on", "off"), "on or off"),
    # Trackio (train/tracking.py): the project the nodes log to, or off
    "ORCH_TRACK": (_project, "off or a Trackio project name (letters, digits, _ and -, at most 100)"),
    # the final model pushed to the Hugging Face Hub (train/hub.py)
    "ORCH_PUSH_TO_HUB": (_repo_id, "a Hub repo id, <owner>/<name> (letters, digits, -, _ and .)"),
    # where the training processes run (the local backend sets cpu), and what the launch side checks before sending
    "ORCH_DEVICE": (_choice("gpu", "cpu"), "gpu or cpu"),
    "ORCH_REHEARSAL": ON_OFF,
    # the memory checks (core/fit.py) on the launch side and the head node: off launches what they would refuse
    "ORCH_MEMORY_CHECK": ON_OFF,
    # the disk check (core/disk_need.py): off launches a run whose download and checkpoints outgrow disk_size
    "ORCH_DISK_CHECK": ON_OFF,
    # the precision check (core/precision.py check_gpu): off launches bf16 on a GPU without bf16 tensor cores
    "ORCH_PRECISION_CHECK": ON_OFF,
    # the CUDA arch check (core/cuda_arch.py): off launches a GPU the nodes' torch build has no kernels for
    "ORCH_CUDA_ARCH_CHECK": ON_OFF,
    # resume from a checkpoint trained with other settings (train/run_config.py says which)
    "ORCH_RESUME_CHANGED": ON_OFF,
    "ORCH_SHOW_NOTICES": ON_OFF,  # third-party notices the node hides (node/output.py NOTICES)
    # `orch node` trains the recipe's tiny model on synthetic data, built on the node (a CPU cluster, a first check)
    "ORCH_SMOKE": ON_OFF,
    # off: the training processes run as if bitsandbytes were not installed (core/bnb.py; smoke runs set it)
    "ORCH_BITSANDBYTES": ON_OFF,
    # the head node prints the run's summary from the rank reports when training ends (core/summary.py); the local
    # backend sets off and prints it itself, once every node is done
    "ORCH_SUMMARY": ON_OFF,
    "ORCH_DATA_CHECK": ON_OFF,
    # the Kernels Hub attention kernel checked before a cloud launch (launch/kernelcheck.py)
    "ORCH_KERNEL_CHECK": ON_OFF,
    # seconds between the node setup's download progress lines (train/prefetch.py)
    "ORCH_PREFETCH_PROGRESS_S": SECONDS,
    # set by the launch side and the node launcher for the training processes
    "ORCH_LAUNCHED_AT": (_time, "a Unix time in seconds"),
    "ORCH_PRICES": (_prices, 'a JSON object of "<cloud>/<region>": price in dollars per hour'),
}


# orch's other variables, read as they are (paths, ports, ids) or set by orch itself for its own processes: with KNOBS,
# every ORCH_ name orch reads (tests/test_layout.py greps the package, scripts and recipes for others)
OTHER = {
    "ORCH_HOME": "the node's orch home (~/.orch)", "ORCH_VENV": "the environment node-setup.sh makes",
    "ORCH_CACHE_DIR": "orch's cache (smoke models, rehearsals)", "ORCH_SCRATCH_DIR": "room for resharded checkpoints",
    "ORCH_BARRIER_PORT": "orch's barrier port (MAIN_PROCESS_PORT + 1)",
    "ORCH_GPUS_PER_NODE": "processes per node where no GPU is counted (CPU nodes)",
    "ORCH_SMOKE_GLOBAL_BATCH": "a smoke run's global batch", "ORCH_SKIP_SETUP": "examples/slurm: skip the setup",
    "ORCH_SKIP_PREFETCH": "node-setup.sh: no model download", "ORCH_DEBUG": "the rehearsal's tracebacks",
    "ORCH_RECIPE": "the default recipe", "ORCH_RUN_ID": "set by orch: the run's name, keying its checkpoints",
    "ORCH_RUN_TOKEN": "set by orch: one attempt's id", "ORCH_NODE_PID": "set by orch node",
    "ORCH_NODE_WORKDIR": "set by orch's CLI", "ORCH_PROGRESS_DIR": "set by orch node",
    "ORCH_TIMELINE": "set by orch node",
}  # fmt: skip


def check_name(name: str, where: str) -> None:
    """A task variable in orch's namespace is one orch reads: a misspelt knob (ORCH_MAX_COST with an S) would be dropped
    without a word, the cap it meant never applied."""
    if name.startswith("ORCH_") and name not in KNOBS and name not in OTHER:
        near = closest(name.removeprefix("ORCH_"), [k.removeprefix("ORCH_") for k in (*KNOBS, *OTHER)], 0.7)
        hint = f"did you mean ORCH_{near}? " if near else ""  # the names' common prefix left out of the likeness
        raise OrchError(f"{where}: orch reads no variable {name}; {hint}orch's knobs are core/knobs.py's KNOBS")


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


def flag(option: str, name: str, raw: str):
    """A command-line flag's value parsed as the knob it sets (--max-cost: ORCH_MAX_COST), its error naming the flag the
    user typed."""
    parse, takes = KNOBS[name]
    try:
        return parse(raw.strip())
    except (ValueError, KeyError):
        raise OrchError(f"{option} {raw!r}: {option} takes {takes}") from None


def check_knobs(env: Mapping[str, str]) -> None:
    for name in KNOBS:
        knob(env, name)
    ports(env)
    root = env.get("CHECKPOINT_ROOT", "")
    if ".." in root.split("/"):
        raise OrchError(f"CHECKPOINT_ROOT={root!r} climbs out of its directory with '..': give the checkpoint "
                        "directory itself (on the bucket's mount point for durable checkpoints)")  # fmt: skip


def ports(env: Mapping[str, str]) -> dict[str, int]:
    """Every port a node listens on, as the node derives it (the same on every rank): accelerate's rendezvous,
    orch's barrier (default rendezvous + 1) and a vLLM server's. One error when one falls outside 1-65535 or two
    collide."""
    main = int(env_port(env, "MAIN_PROCESS_PORT", 29500))
    if not env.get("ORCH_BARRIER_PORT", "").strip() and main + 1 > 65535:
        raise OrchError(f"MAIN_PROCESS_PORT={main}: orch's barrier listens on the next port ({main + 1}), which no "
                        "TCP port is: use a port up to 65534, or set ORCH_BARRIER_PORT")  # fmt: skip
    found = {"MAIN_PROCESS_PORT": main, "ORCH_BARRIER_PORT": int(env_port(env, "ORCH_BARRIER_PORT", main + 1))}
    if env.get("VLLM_SERVER_NODES", "").strip() not in ("", "0"):
        found["VLLM_SERVER_PORT"] = int(env_port(env, "VLLM_SERVER_PORT", 8000))
    else:
        env_port(env, "VLLM_SERVER_PORT", 8000)
    taken: dict[int, str] = {}
    for name, port in found.items():
        if port in taken:
            raise OrchError(f"{name}={port} is {taken[port]}'s port too: give each its own")
        if port in NODE_PORTS:
            who = name if env.get(name, "").strip() else f"{name} (unset: MAIN_PROCESS_PORT + 1)"
            raise OrchError(f"{who} is {port}, where every SkyPilot node runs {NODE_PORTS[port]}: the node's listener "
                            "would fail to bind after the launch; choose a free port (accelerate's default "
                            "MAIN_PROCESS_PORT is 29500)")  # fmt: skip
        taken[port] = name
    return found


NODE_PORTS = {
    22: "sshd (SkyPilot reaches its nodes over SSH)",
    6380: "SkyPilot's Ray head (sky.skylet.constants.SKY_REMOTE_RAY_PORT)",
    8076: "Ray's object manager (SkyPilot's `ray start --object-manager-port`)",
    8266: "SkyPilot's Ray dashboard (SKY_REMOTE_RAY_DASHBOARD_PORT)",
    46590: "SkyPilot's skylet (SKYLET_GRPC_PORT)",
}
"""Ports SkyPilot's own services hold on its nodes (a test reads SkyPilot's constants)."""


def env_port(env: Mapping[str, str], name: str, default: int) -> str:
    """A TCP port from the env (a recipe's MAIN_PROCESS_PORT, ORCH_BARRIER_PORT, ...), default when unset."""
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise OrchError(f"{name}={raw!r} is not a TCP port (1-65535)")
    return raw


SKYPILOT_SETS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE",
                 "SKYPILOT_SETUP_NUM_GPUS_PER_NODE", "SKYPILOT_TASK_ID")
"""What SkyPilot sets on every node of a task (sky.skylet.constants, compared by a test): orch's layout reads them."""
ACCELERATE_SETS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                   "NODE_RANK")
"""What `accelerate launch` (torchrun) sets for each training process, as do ACCELERATE_* variables."""


def set_by_launchers(name: str, in_process: bool = False) -> str:
    """Why a task env (or, `in_process`, a TRL config's env, set inside every rank) may not set `name` ('' when it
    may): the launchers set it per node or per process from orch's layout, and a value given there put every rank on
    one GPU (CUDA_VISIBLE_DEVICES=0) or every node at rank 0. A task env's RANK or ACCELERATE_* is set again by
    `accelerate launch` for each process (ACCELERATE_CONFIG is orch's own)."""
    if name == "CUDA_VISIBLE_DEVICES":
        return ("it would leave each node's processes fewer GPUs than orch starts (one per GPU of the node, which "
                "--gpus chooses), and a rank asking for its own GPU would find none")  # fmt: skip
    if name in SKYPILOT_SETS:
        return f"SkyPilot sets {name} on every node itself, and orch lays out the ranks by it"
    if in_process and (name in ACCELERATE_SETS or name.startswith("ACCELERATE_")):
        return f"`accelerate launch` sets {name} for each training process from orch's layout"
    return ""

