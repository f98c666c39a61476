"""Node side, with effects: `orch node` prints its plan (node/plan.py), or passes orch's barrier and runs it under
the progress watchdog (node/supervise.py); a vLLM server node serves until the trainers are done (node/vllm.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.core.errors import NotRetried, OrchError, RetryableError
from orchestrator.core.home import SAVE_DONE, SAVE_REQUEST, account_home, orch_home
from orchestrator.core.knobs import env_port, knob
from orchestrator.core.timeline import setup_times_file
from orchestrator.core.topology import Topology
from orchestrator.node import vllm
from orchestrator.node.env import from_env
from orchestrator.node.plan import DEFAULT_PORT, describe, plan_from_env, render
from orchestrator.node.price import provisioned

if TYPE_CHECKING:
    from orchestrator.core.smoke import SmokePlan


def node_env(env: Mapping[str, str], build_smoke: bool = True) -> Mapping[str, str]:
    """The environment `orch node` plans from: with ORCH_SMOKE=on the recipe's tiny model and data (smoke_env; built
    here unless build_smoke is False), and a CHECKPOINT_ROOT under `~` made absolute with this account's home (on
    Slurm, SkyPilot points $HOME at a per-cluster directory; the account's home is the shared one that outlives the
    cluster)."""
    root = env.get("CHECKPOINT_ROOT", "").strip()
    if root == "~" or root.startswith("~/"):
        env = {**env, "CHECKPOINT_ROOT": account_home() + root[1:]}
    if knob(env, "ORCH_SMOKE", "off") == "on":
        env = smoke_env(env, build=build_smoke)
    return env


def run(print_only: bool, env: Mapping[str, str] | None = None) -> int:
    """`orch node`: print the plan; unless print_only, pass the barrier and run accelerate under the watchdog."""
    env = node_env(os.environ if env is None else env)
    started = time.time()
    node_plan = plan_from_env(env, cpus=usable_cpus())
    if print_only:
        print(describe(node_plan.cluster))
        print(render(node_plan.argv, node_plan.env))
        return 0
    topo = node_plan.topology
    check_torch(env, topo.gpus_per_node)
    times = setup_times(env)
    _barrier(env, node_plan.cluster, own_setup_seconds(times, started), node_plan.argv)
    timeline = {**times, "node_started": started, "barrier_passed": time.time()}
    if node_plan.role == "vllm-server":
        print(f"[orch] node {topo.node_rank}: vLLM server for the trainers on {topo.nodes - 1} node(s)", flush=True)
        print("[orch] run: " + render(node_plan.argv), flush=True)
        return vllm.serve_until_training_ends(
            node_plan.argv, topo.head_ip, int(env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT))
        )
    print(
        f"[orch] node {topo.node_rank}/{topo.nodes}: {topo.gpus_per_node} process(es) here, "
        f"{topo.total_gpus} in all, head {topo.head_ip}, running {node_plan.runs_as}"
        + ("" if node_plan.cluster.source == "SkyPilot" else f" ({node_plan.cluster.source})"),
        flush=True,
    )
    for note in node_plan.notes:
        print(f"[orch] note: {note}", flush=True)
    print("[orch] launch: " + render(node_plan.argv, node_plan.env), flush=True)
    # The training processes finish the time-to-first-step record (orchestrator/train/callbacks.py).
    child_env = {**env, **node_plan.env, "ORCH_TIMELINE": json.dumps(timeline)}
    price, said = provisioned(env)
    if price:
        child_env["ORCH_PRICE_PER_HOUR"] = price
    if said and topo.node_rank == 0:
        print(f"[orch] {said}", flush=True)
    child_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this environment's tools
    main_port = node_plan.cluster.port or int(env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT))
    from orchestrator.node.supervise import supervise  # not for --print: it costs a third of its start-up

    gpus = knob(env, "ORCH_DEVICE", "gpu") != "cpu"
    code = supervise(
        runnable(node_plan.argv),
        child_env,
        node_rank=node_plan.cluster.node_rank,
        ips=node_plan.cluster.node_ips,
        probe_port=int(env_port(env, "ORCH_BARRIER_PORT", main_port + 1)),
        gpus=gpus,
        # a GPU node names an out-of-memory fix itself; a local (CPU) run's launch side does, with --auto-fit
        settings=node_plan.settings if gpus else None,
        processes=node_plan.topology.total_gpus,
        sizes=node_plan.sizes,
    )
    if code == 0 and topo.node_rank == 0 and knob(env, "ORCH_SUMMARY", "on") == "on":
        summarise(node_plan.argv, node_plan.settings)
    return code


def check_torch(env: Mapping[str, str], processes: int) -> None:
    """A GPU node's torch must not be a CPU build (read from its version file, torch not imported): its processes
    would each train alone on the CPU (core/torch_build.py). What only torch can say, each rank checks
    (train/devices.py)."""
    from orchestrator.core import torch_build

    if knob(env, "ORCH_DEVICE", "gpu") == "cpu":
        return
    build = torch_build.installed()
    if build is not None and build.cpu_only:
        raise OrchError(torch_build.cpu_build_refusal(build, processes))


def summarise(argv: list[str], settings: Mapping[str, object]) -> None:
    """The run's summary on the head node, read back from the rank reports in its output_dir (core/summary.py): those
    of the other nodes too where the checkpoint root is shared and already shows them (a bucket mount may lag: the
    line names the ranks that reported). Training succeeded: a report it cannot read is said, not an error. The
    output_dir is the ranks': the last --output_dir of their argv (CHECKPOINT_ROOT/<run id>), else the TRL config's."""
    from pathlib import Path

    from orchestrator.core.summary import summary
    from orchestrator.node.script import output_dir_in

    where = output_dir_in(argv) or settings.get("output_dir")
    if not where:
        return
    output_dir = Path(str(where))
    try:
        lines = summary(output_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        lines = [f"[orch] summary: the rank reports in {output_dir / 'orch'} could not be read ({exc!r})"]
    for line in lines:
        print(line, flush=True)


def runnable(argv: list[str]) -> list[str]:
    """`accelerate launch ARGS` as this environment's Python runs it: `python -m accelerate.commands.launch ARGS`,
    accelerate's own launch parser and launch_command, as the console script runs them. The console script first
    imports every other accelerate subcommand (estimate-memory imports transformers): 10.8 s of CPU against 3.9 s
    per node on a 2-core machine, before any training process starts."""
    if argv[:2] != ["accelerate", "launch"]:
        return argv
    if importlib.util.find_spec("accelerate") is None:
        raise OrchError("accelerate is not installed in orch's environment on this node; the recipe's setup must "
                        "install orch's train extra (scripts/node-setup.sh train)")  # fmt: skip
    return [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]


def checkpoint_now(env: Mapping[str, str], wait: float) -> int:
    """`orch node --checkpoint-now` (the preemption hook orch adds to spot and managed launches): ask this node's
    training processes for a checkpoint at their next step ($ORCH_HOME/checkpoint-request, read by
    train/callbacks.py when ORCH_SAVE_ON_REQUEST=on) and wait until it is written."""

    home = orch_home(env)
    request, done = home / SAVE_REQUEST, home / SAVE_DONE
    home.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    request.write_text(f"{time.time():.3f}\n")
    print(f"[orch] asked the trainers for a checkpoint at their next step; waiting up to {wait:g} s", flush=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if done.exists():
            step, _, path = done.read_text().strip().partition(" ")
            print(f"[orch] checkpoint written at step {step}: {path}", flush=True)
            return 0
        time.sleep(0.5)
    print(f"[orch] no checkpoint within {wait:g} s (is a run with ORCH_SAVE_ON_REQUEST=on training here?)", flush=True)
    return 1


SMOKE_GLOBAL_BATCH = "16"  # as `orch run --local --smoke`


def _smoke_plan(env: Mapping[str, str]) -> tuple[dict, SmokePlan]:
    """The recipe's TRL settings (with TRL_OVERRIDES) and where its smoke run's tiny model and data live: its model
    family and trainer (core/smoke.plan)."""
    from orchestrator.core import configs, overrides

    paired = configs.load(env)
    settings = overrides.effective(paired.trl, overrides.loads(env.get("TRL_OVERRIDES", "")))
    return settings, _smoke(settings, env["TRL_TRAINER"])


def _smoke(settings: Mapping, trainer: str) -> SmokePlan:
    """The tiny model and data of the settings' model family (its config.json's model_type where it can be read:
    node/model_config.py) and trainer."""
    from orchestrator.core import smoke
    from orchestrator.node import model_config

    model = str(settings.get("model_name_or_path", ""))
    return smoke.plan(model, trainer, family=model_config.family(model, settings.get("model_revision")))


def smoke_artifacts(env: Mapping[str, str]) -> SmokePlan:
    """Where a smoke run's tiny model and data live (the recipe's model family, as TRL_OVERRIDES leave it, and its
    trainer)."""
    return _smoke_plan(env)[1]


def smoke_env(env: Mapping[str, str], build: bool = True) -> dict[str, str]:
    """`orch node --recipe FILE --smoke`: the recipe pointed at its tiny model and data (built here unless `build` is
    False, offline, once; the build is atomic, so nodes sharing a cache may race), 8 steps unless TRL_OVERRIDES sets
    its schedule (smoke.SCHEDULE: max_steps, save_steps...), as `orch run --local --smoke` does."""
    from orchestrator.core import bnb, overrides, smoke

    settings, artifacts = _smoke_plan(env)
    if build:
        smoke.ensure(artifacts)
    given = overrides.loads(env.get("TRL_OVERRIDES", ""))
    schedule = {key: value for key, value in given.items() if key in smoke.SCHEDULE}  # the run's length is its own
    words = {**given, **smoke.trl_overrides(artifacts, settings), **schedule}
    return {
        **env,
        "ORCH_SMOKE": "off",  # applied
        "TRL_OVERRIDES": overrides.dumps(words),
        "GLOBAL_BATCH_SIZE": os.environ.get("ORCH_SMOKE_GLOBAL_BATCH", SMOKE_GLOBAL_BATCH),
        "VLLM_SERVER_NODES": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **({} if bnb.uses(lambda key, default: words.get(key, settings.get(key, default))) else {bnb.ENV: "off"}),
    }


def rehearse(env: Mapping[str, str] | None = None) -> int:
    """`orch node --rehearse` (run by scripts/node-setup.sh while the model downloads): on the head node,
    rehearse every distinct role of this cluster against the owners' code (rehearsal/); the other nodes leave it
    to the head. Prints one line, or one `orch: error:` line and exits 2 (the setup, and the job, stop there)."""
    import platform

    from orchestrator.core import accelerate_config, configs, cuda_arch, precision, torch_build
    from orchestrator.node import disk_room, memory, model_config
    from orchestrator.node.env import run_env
    from orchestrator.node.plan import plan
    from orchestrator.rehearsal import driver

    env = run_env(os.environ if env is None else env)
    cluster = from_env(env)
    if cluster.node_rank != 0:
        print(f"[orch] rehearsal: node {cluster.node_rank} leaves it to the head node", flush=True)
        return 0
    # A smoke run's tiny model and data are the ones the rehearsal swaps in: its own process builds them, as it
    # imports the training stack anyway (one process fewer on the head node, ~4 s here); `orch node` builds them
    # where a cached rehearsal did not.
    smoking = knob(env, "ORCH_SMOKE", "off") == "on"
    run_smoke = smoke_artifacts(env) if smoking else None
    env = node_env(env, build_smoke=False)
    paired = configs.load(env)
    ranks = sorted({0, min(1, cluster.nodes - 1), cluster.nodes - 1})
    plans = [plan({**env, "SKYPILOT_NODE_RANK": str(r)}, *paired) for r in ranks]
    trainer, settings = plans[0].trainer, plans[0].settings  # as plan() checked and read them
    capability = memory.gpu_capability()
    build = torch_build.installed()
    if build is not None:  # the GPUs against this environment's torch build, by torch's own table (core/cuda_arch.py)
        cuda_arch.check_node(capability, build.cuda, platform.machine(), build.version, env, memory.driver_cuda())
    if not smoking:  # the recipe's own model against this node's GPUs and host memory, before it downloads
        mixed = accelerate_config.AccelerateConfig.of(paired.accelerate).mixed_precision
        precision.check_gpu(settings, mixed, capability, "this node's GPU", env, on_node=True)  # `sky launch` too
        topo = plans[0].topology
        print(f"[orch] {memory.check(env, trainer, settings, paired.accelerate, topo.nodes, topo.gpus_per_node)}",
              flush=True)  # fmt: skip
        if said := memory.beyond_positions(trainer, settings, paired.accelerate):
            print(said, flush=True)
        room = disk_room.check(env, trainer, settings, paired.accelerate, plans[0].argv, topo.nodes, topo.gpus_per_node)
        print(f"[orch] {room}", flush=True)
    if knob(env, "ORCH_REHEARSAL", "on") == "off":
        _check_values(trainer, paired.trl, env)
        print("[orch] rehearsal: skipped (ORCH_REHEARSAL=off)", flush=True)
        return 0
    artifacts = run_smoke or _smoke(settings, trainer)
    # a bitsandbytes checkpoint (not in a smoke run, which trains the tiny model): rehearsed as the setting that loads
    # one like it (core/models.quantized)
    loads = None if run_smoke else model_config.loads_as(str(settings.get("model_name_or_path", "")),
                                                         settings.get("model_revision"))  # fmt: skip
    quantized, bitsandbytes = driver.quantisation(settings.get, loads)
    batch = driver.Batch(
        trainer=trainer,
        roles=[driver.Role(name, p.argv, p.env, p.role) for name, p in driver.roles(plans)],
        substitute=driver.substitutions(trainer, settings, artifacts.dir, driver.output_dir(), node=True, loads=loads),
        devices=cluster.gpus_per_node,
        smoke=(artifacts.model_type, artifacts.trainer, str(artifacts.dir)),
        quantized=quantized,
        bitsandbytes=bitsandbytes,
        capability=capability,  # this node's GPUs, as the launch side reports its accelerator's
        nvme=True,  # NVMe offload as it is: this node's DeepSpeed builds its async_io op against this node's libaio
    )
    building = run_smoke is not None and not run_smoke.ready
    (outcomes,) = driver.rehearse_batches([batch])
    if building and artifacts.ready:
        # by the rehearsal's process, or by another node sharing this cache while the rehearsal waited for it
        print(f"[orch] smoke: tiny {artifacts.model_type} model and {artifacts.trainer} data ready at {artifacts.dir} "
              "(built during the rehearsal)", flush=True)  # fmt: skip
    for outcome in outcomes:
        if not outcome.ok:
            fix = outcome.fix()
            raise OrchError(
                f"rehearsal: the {outcome.role} would fail on its GPUs ({outcome.stage}: {outcome.error})"
                + (f"; {fix}" if fix else "")
            )
    _check_values(trainer, paired.trl, env)
    print(f"[orch] {driver.summary(outcomes, cluster.total_gpus, batch)}", flush=True)
    return 0


def _check_values(trainer: str, trl_config: Mapping, env: Mapping[str, str]) -> None:
    """What `orch run` checks on the laptop and TRL's parser does not (the choices a trainer checks only as it trains,
    orch's bounds, a TRL config's env:), for plain `sky launch`: after the rehearsal, so that a value of the wrong type
    is quoted in TRL's parser's own words."""
    from orchestrator.core import overrides, trl_schema

    trl_schema.check_config_keys(trainer, trl_config, env.get("TRL_CONFIG", "TRL_CONFIG"))
    trl_schema.check(trainer, overrides.loads(env.get("TRL_OVERRIDES", "")), "TRL_OVERRIDES")


def warm_up(env: Mapping[str, str] | None = None) -> bool:
    """`orch node --rehearse --warm`, after the rehearsal (the setup installed this environment): where no process here
    has compiled what the ranks import (every node but the head; the head after a cached or skipped rehearsal), compile
    it now (node/warm.py). Prints what it did, if anything. True when the head node warmed: its setup timings record
    it for rank 0's time-to-first-step line, which reads the head's alone."""
    from orchestrator.node import warm
    from orchestrator.node.env import run_env

    env = run_env(os.environ if env is None else env)
    line = warm.stack(env, env.get("TRL_TRAINER", ""))
    if line:
        print(f"[orch] {line}", flush=True)
    return bool(line and line.startswith("warmed ")) and from_env(env).node_rank == 0


def setup_times(env: Mapping[str, str]) -> dict[str, float]:
    """What scripts/node-setup.sh recorded on this node (started, installed, prefetched... in its file under
    ORCH_HOME: core/timeline.setup_times_file); the local backend records when orch started the nodes instead
    (ORCH_LAUNCHED_AT)."""
    times: dict[str, float] = {}
    if launched := knob(env, "ORCH_LAUNCHED_AT"):
        times["launched"] = launched
    path = setup_times_file(env, orch_home(env))
    try:
        lines = open(path).read().splitlines() if path else []
    except OSError:
        return times
    for line in lines:
        key, _, value = line.partition("=")
        try:
            times[f"setup_{key}"] = float(value)
        except ValueError:
            continue
    return times


def own_setup_seconds(times: Mapping[str, float], started: float) -> float:
    """How long this node's setup took in this launch (setup_times), 0 for timings of an earlier one: a setup that
    ended 10 minutes or more before `orch node` started (as a `sky exec`, which runs no setup, finds them)."""
    done = times.get("setup_done")
    if done is None or started - done >= 600:
        return 0.0
    return max(0.0, done - times.get("setup_started", done))


def usable_cpus() -> int:
    """Cores this process may run on (a container's cpuset, not the host's count, where the OS says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def _barrier(env: Mapping[str, str], cluster: Topology, setup_seconds: float = 0.0, argv: Sequence[str] = ()) -> None:
    """Every node of a multi-node run passes orch's barrier before starting accelerate (node/barrier.py). `orch run`
    starts each node's run with its setup (launch/resolved.fold_setup), so the nodes come to the barrier as
    their setups end: a node waits ORCH_RENDEZVOUS_TIMEOUT beyond as long as its own setup took (the others do the
    same work at once: a slower download on one is not taken for a node that never comes)."""
    if cluster.nodes < 2:
        return
    from orchestrator.node import barrier

    main_port = cluster.port or int(env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT))
    port = int(env_port(env, "ORCH_BARRIER_PORT", main_port + 1))
    timeout = knob(env, "ORCH_RENDEZVOUS_TIMEOUT", barrier.DEFAULT_TIMEOUT)
    extra = round(setup_seconds)
    print(
        f"[orch] node {cluster.node_rank}: waiting for all {cluster.nodes} nodes at {cluster.head_ip}:{port} "
        f"(timeout {timeout:g} s" + (f" + {extra} s, as long as this node's setup took)" if extra >= 10 else ")"),
        flush=True,
    )
    timeout += extra
    try:
        if cluster.node_rank == 0:
            took = barrier.head_wait(cluster.nodes, port, timeout)
        else:
            took = barrier.worker_join(cluster.node_rank, cluster.head_ip, port, timeout)
    except RetryableError as exc:  # exit 75, unless it keeps coming back (node/retries.py)
        from orchestrator.node import retries
        from orchestrator.node.script import output_dir_in

        if stop := retries.give_up(output_dir_in(argv), cluster.node_rank, None, env):
            raise NotRetried(f"{stop}: {exc}") from None
        raise
    print(f"[orch] node {cluster.node_rank}: all {cluster.nodes} nodes joined in {took:.1f} s", flush=True)
