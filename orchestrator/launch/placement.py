"""Where SkyPilot places a launch and how it recovers, in SkyPilot's spellings (its schema checks them in
backends/sky.to_task), and the price the nodes spend against (node/price.py picks the provisioned region's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.core.errors import EXIT_RETRYABLE, OrchError

if TYPE_CHECKING:
    from orchestrator.launch.resolved import Launch

DEFAULT_RESTARTS = 3  # a managed job's job_recovery.max_restarts_on_errors (`orch run --max-restarts`)
DEFAULT_IDLE_MINUTES = 10  # a cluster `orch run` launched stops by itself: no idle GPUs on the bill
PREEMPTION_HOOK = (
    '"${ORCH_VENV:-$HOME/.orch/venv}/bin/orch" node --checkpoint-now --wait 150'  # SkyPilot's hook: save first
)


def resources(args, launch: Launch) -> dict[str, object]:
    """SkyPilot's placement and recovery fields, in SkyPilot's spellings (its schema checks them in to_task)."""
    recipe = launch.recipe.task.get("resources") or {}
    resources: dict[str, object] = {"use_spot": True} if args.spot else {}
    if args.network_tier:
        resources["network_tier"] = args.network_tier
    elif launch.nodes > 1 and not recipe.get("network_tier"):
        resources["network_tier"] = "best"  # NCCL over InfiniBand/EFA, not plain TCP, between nodes
    if args.infra:
        resources["infra"] = args.infra
    if args.image_id:
        resources["image_id"] = args.image_id
    if args.max_restarts < 0:
        raise OrchError(f"--max-restarts {args.max_restarts}: give 0 or more restarts")
    if args.managed:  # recover on orch's retryable exit too, not only on preemption
        recovery = recipe.get("job_recovery")
        recovery = dict(recovery) if isinstance(recovery, dict) else ({"strategy": recovery} if recovery else {})
        recovery.setdefault("max_restarts_on_errors", args.max_restarts)
        recovery.setdefault("recover_on_exit_codes", [EXIT_RETRYABLE])
        resources["job_recovery"] = recovery
    return resources


def preemption_hook(task: dict) -> None:
    """Spot and managed runs: on SkyPilot's preemption notice the node asks its trainers for a checkpoint first."""
    task["envs"]["ORCH_SAVE_ON_REQUEST"] = "on"
    config = task.setdefault("config", {})
    hooks = config.setdefault("hooks", [])
    if not any(PREEMPTION_HOOK in str(h.get("run", "")) for h in hooks if isinstance(h, dict)):
        hooks.append({"run": PREEMPTION_HOOK, "events": ["preemption"], "timeout": 180})


def price(task: dict, total_gpus: int) -> None:
    """--max-cost needs the cluster's $/h on the nodes: SkyPilot's plan, computed here (-y skipped the question)."""
    from orchestrator.launch import dryrun
    from orchestrator.launch.backends import sky as sky_backend

    try:
        plan = sky_backend.optimize(task)
    except OrchError as exc:
        raise OrchError(
            f"--max-cost needs the cluster's price and SkyPilot's optimizer could not compute it here ({exc}); give "
            "it with --env ORCH_PRICE_PER_HOUR=<$/h for all nodes>"
        ) from None
    dryrun.check_cap(task, plan, total_gpus)
    task["envs"]["ORCH_PRICE_PER_HOUR"] = f"{plan.dollars_per_hour:.4f}"
    price_table(task, plan)


def price_table(task: dict, plan) -> None:
    """Every region's price of the planned cluster, for the head node to pick where it really runs (node/price.py)."""
    import json

    from orchestrator.launch.backends import sky as sky_backend

    if table := sky_backend.region_prices(plan):
        task["envs"]["ORCH_PRICES"] = json.dumps(table, separators=(",", ":"), sort_keys=True)
