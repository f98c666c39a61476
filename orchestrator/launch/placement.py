"""Where SkyPilot places a launch and how it recovers, in SkyPilot's spellings (its schema checks them in
backends/sky.to_task), and the price the nodes spend against (node/price.py picks the provisioned region's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from orchestrator.core import slots
from orchestrator.core.errors import EXIT_RETRYABLE, OrchError

if TYPE_CHECKING:
    from orchestrator.launch.backends import SkyOptions
    from orchestrator.launch.resolved import Launch

DEFAULT_RESTARTS = 3  # a managed job's job_recovery.max_restarts_on_errors (`orch run --max-restarts`)
DEFAULT_IDLE_MINUTES = 10  # a cluster `orch run` launched stops by itself: no idle GPUs on the bill
PREEMPTION_HOOK = (  # SkyPilot's hook: save first
    '"${ORCH_VENV:-${ORCH_HOME:-$HOME/.orch}/venv}/bin/orch" node --checkpoint-now --wait 150'
)


def check_candidates(args, recipe: Mapping) -> None:
    """A recipe's resources.any_of / ordered candidates, which SkyPilot builds as the top-level resources updated with
    each candidate's keys (sky/resources.py `_override_resources`): a key a candidate names wins over the top level's,
    silently. orch plans one accelerator type (processes per node, the global batch, the memory check), so candidates
    may not name accelerators, nor a field a flag of this launch sets."""
    flags = {"use_spot": "--spot" if args.spot else "", "infra": "--infra" if args.infra else "",
             "image_id": "--image-id" if args.image_id else "",
             "disk_size": "--disk-size" if getattr(args, "disk_size", None) is not None else "",
             "network_tier": "--network-tier" if args.network_tier else ""}  # fmt: skip
    for field in ("any_of", "ordered"):
        candidates = recipe.get(field)
        for i, candidate in enumerate(candidates if isinstance(candidates, list) else []):
            if not isinstance(candidate, Mapping):
                continue
            if "accelerators" in candidate:
                raise OrchError(
                    f"resources.{field}[{i}] names accelerators ({candidate['accelerators']}), which SkyPilot puts "
                    "over the top level's and --gpus: orch plans one accelerator type (processes per node, the "
                    "global batch, the memory check); keep one in resources.accelerators and the rest of the "
                    f"candidates' fields in {field}, or launch it with plain `sky launch`"
                )
            for key, flag in flags.items():
                if flag and key in candidate:
                    raise OrchError(f"resources.{field}[{i}] sets {key}, which SkyPilot puts over {flag} (a "
                                    f"candidate's fields win over the top level's): drop {flag} or {key} from the "
                                    f"recipe's {field}")  # fmt: skip


def resources(args, launch: Launch) -> dict[str, object]:
    """SkyPilot's placement and recovery fields, in SkyPilot's spellings (its schema checks them in to_task)."""
    recipe = launch.recipe.task.get("resources") or {}
    resources: dict[str, object] = {"use_spot": True} if args.spot else {}
    if args.network_tier:
        resources["network_tier"] = args.network_tier
    elif launch.nodes > 1 and not recipe.get("network_tier"):
        resources["network_tier"] = "best"  # NCCL over InfiniBand/EFA, not plain TCP, between nodes
    if args.infra:
        resources["infra"] = slots.check("field", args.infra, "--infra")
    if args.image_id:
        resources["image_id"] = args.image_id
    if getattr(args, "disk_size", None) is not None:
        resources["disk_size"] = disk_size(args.disk_size)
    images = resources.get("image_id", recipe.get("image_id"))  # SkyPilot runs `docker pull <it>` unquoted
    for image in images.values() if isinstance(images, dict) else [images] if images else []:
        slots.check("image", str(image), "--image-id" if args.image_id else "resources.image_id")
    if args.max_restarts < 0:
        raise OrchError(f"--max-restarts {args.max_restarts}: give 0 or more restarts")
    if args.managed:  # recover on orch's retryable exit too, not only on preemption
        recovery = recipe.get("job_recovery")
        recovery = dict(recovery) if isinstance(recovery, dict) else ({"strategy": recovery} if recovery else {})
        recovery.setdefault("max_restarts_on_errors", args.max_restarts)
        recovery.setdefault("recover_on_exit_codes", [EXIT_RETRYABLE])
        resources["job_recovery"] = recovery
    return resources


def disk_size(gb: int) -> int:
    """--disk-size: each node's disk in GB (resources.disk_size)."""
    if gb < 1:
        raise OrchError(f"--disk-size {gb}: give each node's disk in GB, 1 or more")
    return gb


def relaunch_disk(gb: int | None, reshaping: bool, run: str) -> dict[str, int]:
    """`orch run --resume RUN --disk-size GB`: the disk of a new shape's cluster (a reused cluster keeps its own)."""
    if gb is None:
        return {}
    if not reshaping:
        raise OrchError(f"--disk-size with --resume {run}: a relaunch at the recorded shape keeps its cluster's disks; "
                        "give --nodes/--gpus for a new shape's cluster, or launch a new run")  # fmt: skip
    return {"disk_size": disk_size(gb)}


def preemption_hook(launch: Launch) -> Launch:
    """Spot and managed runs: on SkyPilot's preemption notice the node asks its trainers for a checkpoint first."""
    config = launch.recipe.task.get("config")
    hooks = config.get("hooks") if isinstance(config, dict) else None
    has = any(PREEMPTION_HOOK in str(h.get("run", "")) for h in hooks or [] if isinstance(h, dict))
    added = () if has else ({"run": PREEMPTION_HOOK, "events": ["preemption"], "timeout": 180},)
    return launch.replace(envs={**launch.envs, "ORCH_SAVE_ON_REQUEST": "on"}, hooks=(*launch.hooks, *added))


def price(launch: Launch, total_gpus: int) -> Launch:
    """--max-cost needs the cluster's $/h on the nodes: SkyPilot's plan, computed here (-y skipped the question)."""
    from orchestrator.launch.backends import sky as sky_backend

    try:
        plan = sky_backend.optimize(launch.task())
    except OrchError as exc:
        raise OrchError(
            f"--max-cost needs the cluster's price and SkyPilot's optimizer could not compute it here ({exc}); give "
            "it with --env ORCH_PRICE_PER_HOUR=<$/h for all nodes>"
        ) from None
    check_cap(launch.envs, plan, total_gpus)
    return priced(launch, plan)


def priced(launch: Launch, plan) -> Launch:
    """The plan's $/h for the nodes' spend (a price the user gave stays), and every region's price of the planned
    cluster, for the head node to pick where it really runs (node/price.py)."""
    import json

    from orchestrator.launch.backends import sky as sky_backend

    envs = dict(launch.envs)
    if plan.dollars_per_hour <= 0:  # SkyPilot prices a Slurm or Kubernetes cluster of one's own at $0: nothing to meter
        return launch
    if not envs.get("ORCH_PRICE_PER_HOUR"):
        envs["ORCH_PRICE_PER_HOUR"] = f"{plan.dollars_per_hour:.4f}"
    if table := sky_backend.region_prices(plan):
        envs["ORCH_PRICES"] = json.dumps(table, separators=(",", ":"), sort_keys=True)
    return launch.replace(envs=envs)


def dollars(envs: Mapping[str, str], plan, total_gpus: int) -> float | None:
    """The recipe's EXPECTED_GPU_HOURS at the plan's price (ideal scaling), None when the recipe does not say."""
    try:
        return float(str(envs.get("EXPECTED_GPU_HOURS", ""))) / total_gpus * plan.dollars_per_hour
    except ValueError:
        return None


def check_cap(envs: Mapping[str, str], plan, total_gpus: int) -> None:
    """Refuse a launch whose estimated cost exceeds ORCH_MAX_COST (--max-cost)."""
    cap = str(envs.get("ORCH_MAX_COST", "")).strip()
    cost = dollars(envs, plan, total_gpus)
    if cap and cost is not None and cost > float(cap):
        raise OrchError(
            f"the estimated cost ${cost:,.2f} exceeds --max-cost ${float(cap):,.2f}: raise the cap, use fewer or "
            "cheaper GPUs (--gpus, --spot), or lower max_steps / num_train_epochs"
        )


def autostop(flags: SkyOptions, cluster: str, run: str, slurm: bool) -> tuple[int | None, bool]:
    """The cluster's autostop in idle minutes (None: none) and whether it is torn down then, said as it will happen.
    A Slurm allocation cannot be stopped (SkyPilot 0.14: autostop needs a Pyxis container there), only ended: on
    Slurm the idle cluster is torn down instead, which loses nothing there (the home and the checkpoints are on the
    cluster's shared file system; a relaunch finds the environment installed)."""
    idle, down = flags.idle_minutes, flags.down
    if flags.managed:  # SkyPilot owns a managed job's cluster and ends it with the job
        return idle, down
    if idle is None and not down and not flags.keep_up:
        idle = DEFAULT_IDLE_MINUTES
    if slurm and idle is not None and not down:
        down = True
        print(f"[orch] cluster {cluster}: its Slurm allocation ends after {idle} idle minutes (SkyPilot cannot "
              "stop one: the shared home keeps the environment and the checkpoints; --keep-up keeps it)",
              flush=True)  # fmt: skip
    elif down:
        after = f"after {idle} idle minutes" if idle is not None else "when the job ends"
        print(f"[orch] cluster {cluster}: torn down {after} (--down)", flush=True)
    elif idle is not None:
        print(f"[orch] cluster {cluster}: stops by itself after {idle} idle minutes (autostop; --down tears it "
              "down instead, --keep-up keeps it up)", flush=True)  # fmt: skip
    else:
        print(f"[orch] cluster {cluster}: kept up after the job (--keep-up): `orch down {run}` ends it", flush=True)
    return idle, down
