"""`orch run --dry-run`: a view of a resolved launch and its checks, computed by the code that launches it."""

from __future__ import annotations

from orchestrator.core import accelerators
from orchestrator.core.errors import OrchError
from orchestrator.core.yamlio import dump_task
from orchestrator.launch import storage
from orchestrator.launch.checks import Checked
from orchestrator.launch.resolved import Launch
from orchestrator.node.plan import render


def _section(title: str) -> None:
    print(f"\n--- {title} ---")


def show(launch: Launch, task: dict, checked: Checked, skip_optimizer: bool, rehearsal: str) -> int:
    if not skip_optimizer:  # SkyPilot's own parser and schema first: one line naming what it rejects, exit 2
        from orchestrator.launch.backends import sky as sky_backend

        sky_backend.to_task(task)
    print(f"[orch] dry run of {launch.recipe.name}: nothing is launched, nothing is written")
    print(f"[orch] {rehearsal}")
    _section("resolved task (what sky_jobs/<run>.yaml will hold)")
    print(dump_task(task).rstrip())
    _section("node commands (node IPs are placeholders: SkyPilot sets the real ones)")
    plans = checked.plans
    shown = [p.cluster.node_rank for p in plans]
    for node_plan in plans:
        rank = node_plan.cluster.node_rank
        print(f"rank {rank}: {render(node_plan.argv)}")
        if rank == 1 and launch.nodes > len(shown):
            print(f"ranks 2..{launch.nodes - 2}: as rank 1, with --machine_rank 2..{launch.nodes - 2}")
    for note in plans[0].notes:
        print(f"note: {note}")
    head = plans[0]
    if head.gradient_accumulation_steps:
        print(
            f"batch: GLOBAL_BATCH_SIZE {launch.envs['GLOBAL_BATCH_SIZE']} = {head.per_device_batch} per device x "
            f"{head.data_parallel_size} data-parallel ranks x {head.gradient_accumulation_steps} accumulation steps"
        )
    if checked.memory is not None:
        name = launch.gpus.name
        print(
            f"memory: {checked.memory.describe()} for weights, gradients and Adam states (activations extra); "
            f"each {name} has {accelerators.memory_gib(name)} GiB"
        )
    else:
        print("memory: not estimated (model size unknown to orch)")
    where = storage.durable_checkpoints(task) or "the nodes' own disks (lost with the cluster)"
    print(f"checkpoints and final model: {where}")
    _section("SkyPilot plan")
    if skip_optimizer:
        print("not computed: --skip-optimizer")
        return 0
    from orchestrator.launch.backends import sky as sky_backend

    print("SkyPilot's task parser and schema: accepted")
    try:
        plan = sky_backend.optimize(task)
    except OrchError as exc:
        print(f"not computed: {exc}")
        print("(the optimizer needs SkyPilot's catalogs and an enabled cloud: run `sky check`)")
        return 0
    print(describe(plan))
    print(estimate(task, plan, head.topology.total_gpus))
    check_cap(task, plan, head.topology.total_gpus)
    return 0


def describe(plan) -> str:
    """SkyPilot's choice in one line: cloud, region, instance, nodes, price."""
    kind = "spot" if plan.use_spot else "on-demand"
    return (
        f"{plan.cloud} {plan.region} {plan.instance_type} x {plan.nodes} node(s), {kind}: "
        f"${plan.node_dollars_per_hour:.2f}/h per node, ${plan.dollars_per_hour:.2f}/h in all"
    )


def dollars(task: dict, plan, total_gpus: int) -> float | None:
    """The recipe's EXPECTED_GPU_HOURS at the plan's price (ideal scaling), None when the recipe does not say."""
    try:
        return float(str(task["envs"].get("EXPECTED_GPU_HOURS", ""))) / total_gpus * plan.dollars_per_hour
    except ValueError:
        return None


def check_cap(task: dict, plan, total_gpus: int) -> None:
    """Refuse a launch whose estimated cost exceeds ORCH_MAX_COST (--max-cost)."""
    cap = str(task["envs"].get("ORCH_MAX_COST", "")).strip()
    cost = dollars(task, plan, total_gpus)
    if cap and cost is not None and cost > float(cap):
        raise OrchError(
            f"the estimated cost ${cost:,.2f} exceeds --max-cost ${float(cap):,.2f}: raise the cap, use fewer or "
            "cheaper GPUs (--gpus, --spot), or lower max_steps / num_train_epochs"
        )


def estimate(task: dict, plan, total_gpus: int) -> str:
    """The recipe's EXPECTED_GPU_HOURS at the plan's price, assuming ideal scaling over the GPUs asked for."""
    gpu_hours = str(task["envs"].get("EXPECTED_GPU_HOURS", "")).strip()
    if not gpu_hours:
        return "estimated cost: not computed: the recipe declares no EXPECTED_GPU_HOURS"
    try:
        hours = float(gpu_hours) / total_gpus
    except ValueError:
        return f"estimated cost: not computed: EXPECTED_GPU_HOURS={gpu_hours!r} is not a number"
    return (
        f"estimated cost: EXPECTED_GPU_HOURS {gpu_hours} / {total_gpus} GPUs = {hours:.2f} h "
        f"(ideal scaling) x ${plan.dollars_per_hour:.2f}/h = ${hours * plan.dollars_per_hour:.2f}"
    )
