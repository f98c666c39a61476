"""`orch run --dry-run`: a view of a resolved launch and its checks, computed by the code that launches it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from orchestrator.core import accelerators, eval_memory, fit, generation_memory, host_fit, precision, vllm_fit
from orchestrator.core.errors import OrchError
from orchestrator.core.memory import GIB
from orchestrator.core.yamlio import dump_task
from orchestrator.launch import preflight, storage
from orchestrator.launch.checks import Checked
from orchestrator.launch.placement import check_cap
from orchestrator.launch.resolved import Launch, fold_setup
from orchestrator.node.plan import render


def _section(title: str) -> None:
    print(f"\n--- {title} ---")


def show(launch: Launch, checked: Checked, skip_optimizer: bool, rehearsal: str) -> int:
    from orchestrator.launch.backends import sky as sky_backend

    task = fold_setup(launch.task())  # as `orch run` sends it
    if not skip_optimizer:  # SkyPilot's own parser and schema first: one line naming what it rejects, exit 2
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
    if checked.memory is not None and launch.gpus is not None and launch.gpus.name:  # estimated for a named GPU
        name, setup = launch.gpus.name, checked.memory.setup
        capacity = accelerators.memory_gib(name)
        print(
            f"memory: {checked.memory.describe()} under {preflight.label(setup)} on {setup.gpus} GPUs, "
            f"{fit.tokens_words(setup)}{vllm_fit.vllm_words(setup, capacity)}; each {name} "
            f"has {capacity} GiB" + ("" if preflight.memory_checked(launch) else
                                                       " (ORCH_MEMORY_CHECK=off: shown, not enforced)")
        )  # fmt: skip
    else:
        gpu = launch.gpus.name if launch.gpus is not None else None
        why = ("CPU nodes: the estimate is of GPU memory" if gpu == accelerators.CPU else
               "no GPU named" if not gpu else preflight.unestimated(launch))  # fmt: skip
        hint = "; `orch plan path/to/config.json` reads one" if why.startswith("orch has no shape") else ""
        print(f"memory: not estimated ({why}{hint})")
    if checked.memory is not None and (during := eval_memory.estimate(checked.memory.setup)):
        print(f"memory while evaluating: {during.describe()} at {eval_memory.words(during.setup)} (eval_strategy)")
    if checked.memory is not None and (making := generation_memory.estimate(checked.memory.setup)):
        print(f"memory while {generation_memory.words(making.setup)}: {making.describe()}")
    if ahead := precision.planned(checked.memory.setup if checked.memory else None):
        print(ahead)
    at_load = preflight.load_memory(launch, checked.memory)  # None where the line above says not estimated
    if at_load is not None:
        print(f"memory at load: {at_load.describe()}")
    if offloaded := preflight.offloaded_host_gib(launch, checked.memory):
        print(f"host memory while training: ~{offloaded:.1f} GiB per node (CPU offload: the node's share of the "
              "weights and Adam's moments)")
    if checked.memory is not None and (swapped := host_fit.nvme_gib(checked.memory.setup, launch.nodes)):
        paths = " and ".join(sorted(set(launch.paired.accelerate.nvme_paths.values())))
        print(f"NVMe while training: ~{swapped:.1f} GiB per node in {paths} (DeepSpeed's offload to nvme: the node's "
              "share of the states CPU offload would keep in host memory; the head node checks its room)")
    where = storage.durable_checkpoints(task) or "the nodes' own disks (lost with the cluster)"
    print(f"checkpoints and final model: {where}")
    trainer_nodes = launch.nodes - (1 if plans[-1].role == "vllm-server" else 0)
    if checked.memory is not None and (need := preflight.disk(launch, checked.memory.setup, trainer_nodes)):
        off = "" if need.fits else " (ORCH_DISK_CHECK=off: shown, not enforced)"
        print(f"disk: {need.describe()}{off}")
    _section("SkyPilot plan")
    if skip_optimizer:
        print("not computed: --skip-optimizer")
        return 0
    print("SkyPilot's task parser and schema: accepted")
    try:
        plan = sky_backend.optimize(task)
    except OrchError as exc:
        print(f"not computed: {exc}")
        print("(the optimizer needs SkyPilot's catalogs and an enabled cloud: run `sky check`)")
        return 0
    print(describe(plan))
    print(estimate(task, plan, head.topology.total_gpus))
    check_cap(task["envs"], plan, head.topology.total_gpus)
    if host := preflight.check_host_memory(launch, checked.memory, plan):
        print(host)
    return 0


def describe(plan) -> str:
    """SkyPilot's choice in one line: cloud, region, instance, nodes, price."""
    kind = "spot" if plan.use_spot else "on-demand"
    return (
        f"{plan.cloud} {plan.region} {plan.instance_type} x {plan.nodes} node(s), {kind}: "
        f"${plan.node_dollars_per_hour:.2f}/h per node, ${plan.dollars_per_hour:.2f}/h in all"
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


Planner = Callable[[], object]  # waits for SkyPilot's plan and returns it, or raises why there is none


def plan_ahead(launch: Launch) -> Planner:
    """SkyPilot's optimizer on the launch's task, started now in a thread: it runs while the rehearsal does (a process
    of its own, seconds where it is not cached; the optimizer reads SkyPilot's catalogs, or asks a Slurm cluster for
    its nodes, seconds too), and `planned` takes its answer: the plan, or the OrchError it raised. A daemon thread: a
    launch that stops before (a refused rehearsal, Ctrl-C) does not wait for it."""
    from orchestrator.launch.backends import sky as sky_backend

    task = launch.task()
    plans: list[object] = []
    errors: list[BaseException] = []  # OrchError (no plan here) or a bug: raised where the plan is taken

    def work() -> None:
        try:
            plans.append(sky_backend.optimize(task))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=work, name="orch-skypilot-plan", daemon=True)
    thread.start()

    def take() -> object:
        thread.join()
        if errors:
            raise errors[0]
        return plans[0]

    return take


def planned(launch: Launch, checked: Checked, ahead: Planner | None = None) -> tuple[object, OrchError | None]:
    """SkyPilot's plan for the launch (`ahead`'s, started before the rehearsal, else computed now), with the checks it
    allows printed: its choice, the cost estimate against --max-cost, host memory at load against the planned
    node's. (plan, None), or (None, the reason the optimizer gave) where this machine has no catalog or cloud for
    it."""
    from orchestrator.launch.backends import sky as sky_backend

    task = launch.task()
    total = checked.plans[0].topology.total_gpus
    try:
        plan = ahead() if ahead is not None else sky_backend.optimize(task)
    except OrchError as reason:
        return None, reason
    print(f"[orch] SkyPilot's plan: {describe(plan)}")
    print(f"[orch] {estimate(task, plan, total)}")
    check_cap(task["envs"], plan, total)
    if host := preflight.check_host_memory(launch, checked.memory, plan):
        print(f"[orch] {host}")
    return plan, None


def confirm(launch: Launch, checked: Checked, managed: bool, ahead: Planner | None = None) -> tuple[bool, object]:
    """Show what SkyPilot would launch and its price, then ask: (the answer, SkyPilot's plan or None). SkyPilot's
    optimizer runs in this process when the catalogs and credentials are here, else on the API server (which prints
    its own table of choices)."""
    from orchestrator.launch.backends import sky as sky_backend

    task = launch.task()
    what = "managed job" if managed else "cluster"
    print(f"[orch] {launch.recipe.name}: {launch.nodes} node(s) x {launch.gpus} as a {what}")
    print(f"[orch] checkpoints and final model: {storage.durable_checkpoints(task) or 'on the nodes (not durable)'}")
    if said := precision.planned(checked.memory.setup if checked.memory else None):
        print(f"[orch] {said}")
    plan, reason = planned(launch, checked, ahead)
    if plan is None:
        try:
            sky_backend.show_server_plan(task)
            print("[orch] SkyPilot's plan and price: above (its optimizer, run by your API server)")
        except OrchError:
            print(f"[orch] {_not_planned(reason)}")
    try:
        answer = input("Launch? [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes"), plan


def _not_planned(reason: OrchError | None) -> str:
    return f"SkyPilot's plan: not computed here ({reason}); SkyPilot picks the cheapest match at launch"


def unplanned(launch: Launch, checked: Checked, reason: OrchError) -> str:
    """What -y launches without, where SkyPilot's plan could not be computed here."""
    said = _not_planned(reason)
    if loading := preflight.load_memory(launch, checked.memory):
        offloaded = preflight.offloaded_host_gib(launch, checked.memory)
        steady = f", ~{offloaded:.1f} GiB per node while training (CPU offload)" if offloaded else ""
        return f"{said}; host memory at load: ~{loading.node / GIB:.1f} GiB on the busiest node{steady}, unchecked"
    return said
