"""`orch run RECIPE`: resolve a recipe with the user's flags, check it, record it in sky_jobs/, launch it."""

from __future__ import annotations

import argparse
import re
import sys
import time

from orchestrator import accelerators, overrides, storage
from orchestrator.commands import add
from orchestrator.errors import OrchError
from orchestrator.recipe import Recipe, check_paired_files, load, parse_env_assignments, resolve

EPILOG = """\
examples:
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2              # cluster launch through the SkyPilot SDK
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2 --dry-run    # resolved task, every rank's command, plan, $/h
  orch run llama3_sft_fsdp --managed --spot --secret HF_TOKEN # managed job: SkyPilot recovers preemptions
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke            # 2 emulated nodes, CPU, tiny Phi-3
  orch run phi3_dpo_fsdp --local --nodes 1 --gpus CPU:2 --smoke max_steps=4   # key=value overrides TRL

Which side wins: flags you give override the recipe (--gpus beats resources.accelerators, --nodes beats
num_nodes, --env beats envs); key=value words override the TRL config. Every run is recorded as
sky_jobs/<run>.yaml, which `sky launch sky_jobs/<run>.yaml` relaunches. `orch ls` lists the recipes.

Before a cloud launch orch shows SkyPilot's choice and its $/h (and the recipe's cost estimate) and asks;
-y skips the question. A managed job, a multi-node run or --down needs checkpoints on a mounted bucket
(CHECKPOINT_ROOT): the nodes' own disks are lost with the cluster. Several nodes get network_tier: best
(InfiniBand/EFA where the cloud has it) unless the recipe sets a tier.
"""

SMOKE_GLOBAL_BATCH = 16
_CLUSTER = re.compile(r"^[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$")


def register(sub: argparse._SubParsersAction) -> None:
    p = add(
        sub,
        "run",
        help="resolve a recipe and launch it (SkyPilot, or --local)",
        description="Resolve a recipe (task YAML + Accelerate + TRL configs) with your flags, check it and launch it.",
        epilog=EPILOG,
    )
    p.add_argument("recipe", help="recipe name (see `orch ls`) or path to a recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="TRL arguments; override the TRL config")
    p.add_argument(
        "--gpus",
        metavar="ACC:N",
        help="accelerators per node, e.g. A100:8 or 4 (keeps the type); "
        "overrides the recipe's. With --local: CPU:N processes per node",
    )
    p.add_argument(
        "--nodes",
        "--num-nodes",
        dest="nodes",
        type=int,
        metavar="N",
        help="number of nodes; overrides the recipe's num_nodes",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="set a task env (repeatable), over the recipe's envs; `--env K` takes K from your environment",
    )
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass a secret (repeatable); without =VALUE it is read from your environment. "
        "Secrets travel as SkyPilot secrets and are never written to sky_jobs/ or logs",
    )
    cloud = p.add_argument_group("SkyPilot launch (without --local)")
    cloud.add_argument(
        "--managed", action="store_true", help="launch as a managed job (sky jobs launch): relaunched after preemption"
    )
    cloud.add_argument("--spot", action="store_true", help="use spot instances (resources.use_spot)")
    cloud.add_argument("--cluster", metavar="NAME", help="cluster name (default: the run name)")
    cloud.add_argument("--idle-minutes", type=int, metavar="M", help="autostop the cluster after M idle minutes")
    cloud.add_argument("--down", action="store_true", help="tear the cluster down when the job finishes")
    cloud.add_argument("--detach", action="store_true", help="return once submitted; `orch logs RUN` follows later")
    cloud.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="launch without asking: orch otherwise shows SkyPilot's plan and price and asks first "
        "(required when stdin is not a terminal)",
    )
    cloud.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved task, every rank's command and SkyPilot's plan; launch nothing",
    )
    cloud.add_argument("--skip-optimizer", action="store_true", help="with --dry-run: do not run the optimizer")
    local = p.add_argument_group("local emulation")
    local.add_argument("--local", action="store_true", help="emulate the nodes on this machine (CPU processes)")
    local.add_argument(
        "--fresh",
        action="store_true",
        help="start over: delete this run's earlier checkpoints instead of resuming from them",
    )
    local.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model of the recipe's architecture + synthetic data, built here offline; 8 steps",
    )
    p.set_defaults(func=main)


def parse_secrets(words: list[str]) -> dict[str, str]:
    import os

    out = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise OrchError(f"--secret: {name!r} is not an environment variable name (for example HF_TOKEN)")
        if not sep:
            if not os.environ.get(name):
                raise OrchError(
                    f"--secret {name}: {name} is not set in your environment; export it or use {name}=VALUE"
                )
            value = os.environ[name]
        out[name] = value
    return out


def redacted_command(argv: list[str]) -> str:
    """The command as typed, with secret values removed (names kept)."""
    import shlex

    out, after_secret = [], False
    for word in argv:
        if after_secret:
            word = word.partition("=")[0]
        elif word.startswith("--secret="):
            word = "--secret=" + word[len("--secret=") :].partition("=")[0]
        after_secret = word == "--secret"
        out.append(word)
    return "orch " + " ".join(shlex.quote(w) for w in out)


def _secrets_for(recipe: Recipe, given: dict[str, str], smoke: bool) -> dict[str, str]:
    """Secret values: the recipe's non-null ones, then --secret. A null one must be given, except in smoke
    mode, which never reaches a hub."""
    declared = recipe.task.get("secrets") or {}
    values = {k: str(v) for k, v in declared.items() if v is not None}
    values.update(given)
    missing = [k for k in declared if k not in values and not smoke]
    if missing:
        raise OrchError(f"recipe needs secret {missing[0]}: pass --secret {missing[0]} (read from your environment)")
    return values


def main(args: argparse.Namespace) -> int:
    recipe = load(args.recipe)
    if args.nodes is not None and args.nodes < 1:
        raise OrchError(f"--nodes {args.nodes}: a run needs at least 1 node")
    if args.idle_minutes is not None and args.idle_minutes < 0:
        raise OrchError(f"--idle-minutes {args.idle_minutes}: give 0 or more minutes")
    if args.cluster and not _CLUSTER.match(args.cluster):
        raise OrchError(f"--cluster {args.cluster!r}: use letters, digits, '-', '_' or '.', starting with a letter")
    gpus = accelerators.parse(args.gpus) if args.gpus else None
    user_envs = parse_env_assignments(args.env)
    user_overrides = overrides.parse(args.overrides)
    secrets = _secrets_for(recipe, parse_secrets(args.secret), smoke=args.smoke)
    check_paired_files(recipe)
    if args.local:
        if args.managed or args.spot or args.cluster or args.dry_run or args.detach:
            raise OrchError(
                "--managed, --spot, --cluster, --detach and --dry-run are for SkyPilot launches, not --local"
            )
        return _local(args, recipe, gpus, user_envs, user_overrides, secrets)
    if args.smoke or args.fresh:
        raise OrchError("--smoke and --fresh are for runs on this machine: add --local")
    return _cloud(args, recipe, gpus, user_envs, user_overrides, secrets)


def check_trl(recipe: Recipe, task: dict, trl_config: dict) -> None:
    """TRL config keys and every key=value override exist for the trainer and have the right type."""
    from orchestrator import trl_schema

    trl_schema.check_config_keys(recipe.trainer, trl_config, task["envs"]["TRL_CONFIG"])
    trl_schema.check(recipe.trainer, overrides.loads(task["envs"].get("TRL_OVERRIDES", "")))


def check(recipe: Recipe, task: dict, spec: str | None, nodes: int, procs: int, device: str = "gpu", task_id=None):
    """Every launch-side check of a resolved task, reading its two configs once: TRL arguments, preflight
    (memory only with a GPU spec), and each rank's node plan. Returns (plans, memory estimate)."""
    from orchestrator import node, preflight

    configs = node.load_configs(task["envs"], strict=False)
    accel, trl_config, _ = configs
    check_trl(recipe, task, trl_config)
    kw = {"task_id": task_id} if task_id else {}
    plans = node.preview(task["envs"], nodes, procs, device=device, configs=configs, **kw)
    trainers = nodes - (1 if plans[-1].role == "vllm-server" else 0)
    user = overrides.loads(task["envs"].get("TRL_OVERRIDES", ""))
    memory = preflight.run(accel, trl_config, user, recipe.trainer, spec, trainers)
    return plans, memory


def _record_secrets(task: dict, secrets: dict[str, str]) -> dict:
    """The task as written to sky_jobs/: secret names only, never values."""
    if secrets:
        task["secrets"] = {name: None for name in secrets}
    return task


def _cloud(args, recipe, gpus, user_envs, user_overrides, secrets) -> int:
    from orchestrator import records

    if gpus and gpus.name == accelerators.CPU:
        raise OrchError(f"--gpus {args.gpus}: CPU processes are for --local; on a cloud give a GPU, e.g. A100:8")
    spec = recipe.accelerators
    if gpus:
        spec = gpus.spec(accelerators.parse(spec).name if spec else None)
        if spec.startswith("None:"):
            raise OrchError(
                f"--gpus {args.gpus}: the recipe names no accelerator; give one, e.g. --gpus A100:{gpus.count}"
            )
    elif spec:
        accelerators.parse(spec)  # an unknown name in the recipe is caught before anything is sent
    if not spec:
        raise OrchError("the recipe has no resources.accelerators; pass --gpus, e.g. --gpus A100:8")
    task = resolve(recipe, nodes=args.nodes, accelerators=spec, envs=user_envs, trl_overrides=user_overrides)
    if args.spot:
        task["resources"]["use_spot"] = True
    nodes = int(task.get("num_nodes") or 1)
    if nodes > 1 and not task["resources"].get("network_tier"):
        task["resources"]["network_tier"] = "best"  # NCCL over InfiniBand/EFA, not plain TCP, between nodes
    # Batch math, parallelism, memory and env errors surface here, before anything is sent.
    plans, memory = check(recipe, task, spec, nodes, accelerators.parse(spec).count)
    reasons = {"a managed job's recovery": args.managed, f"a run on {nodes} nodes": nodes > 1, "--down": args.down}
    if any(reasons.values()):
        storage.require_durable(task, [why for why, applies in reasons.items() if applies])
    task = _record_secrets(task, secrets)
    run = f"{recipe.name.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    cluster = args.cluster or run
    if args.dry_run:
        from orchestrator.commands import dryrun

        return dryrun.show(recipe, task, plans, memory, skip_optimizer=args.skip_optimizer)
    if not args.yes and not sys.stdin.isatty():
        raise OrchError("a cloud launch asks before it spends money, but stdin is not a terminal: pass -y to launch")
    from orchestrator.backends import sky as sky_backend

    sky_backend.to_task(task, secrets)  # SkyPilot's own validation, before anything is asked or written
    if not args.yes and not _confirm(recipe, task, plans, args.managed):
        print("[orch] not launched", flush=True)
        return 1
    record = records.new(
        run,
        task,
        recipe.path,
        redacted_command(args.argv),
        backend=sky_backend.BACKEND_MANAGED if args.managed else sky_backend.BACKEND_CLUSTER,
        cluster="" if args.managed else cluster,
        state="launching",
    )
    path = records.write(record)
    print(
        f"[orch] run {run}: {recipe.name} on {nodes} x {spec}{' (spot)' if args.spot else ''}, "
        f"{'managed job' if args.managed else f'cluster {cluster}'}; recorded in {path}",
        flush=True,
    )

    def submitted(meta: dict) -> None:
        record.meta.update(meta)
        records.write(record)
        print(f"[orch] submitted: {', '.join(f'{k}={v}' for k, v in meta.items() if v)}", flush=True)

    return sky_backend.launch(
        task,
        secrets,
        run=run,
        managed=args.managed,
        cluster=cluster,
        idle_minutes=args.idle_minutes,
        down=args.down,
        detach=args.detach,
        on_submitted=submitted,
    )


def _confirm(recipe, task: dict, plans, managed: bool) -> bool:
    """Show what SkyPilot would launch and its price, then ask. SkyPilot's optimizer runs in this process when the
    catalogs and credentials are here, else on the API server (which prints its own table of choices)."""
    from orchestrator.backends import sky as sky_backend
    from orchestrator.commands import dryrun

    total = plans[0].topology.total_gpus
    what = "managed job" if managed else "cluster"
    print(f"[orch] {recipe.name}: {task['num_nodes']} node(s) x {task['resources']['accelerators']} as a {what}")
    print(f"[orch] checkpoints and final model: {storage.durable_checkpoints(task) or 'on the nodes (not durable)'}")
    try:
        plan = sky_backend.optimize(task)
        print(f"[orch] SkyPilot's plan: {dryrun.describe(plan)}")
        print(f"[orch] {dryrun.estimate(task, plan, total)}")
    except OrchError as local:
        try:
            sky_backend.show_server_plan(task)
            print("[orch] SkyPilot's plan and price: above (its optimizer, run by your API server)")
        except OrchError:
            print(f"[orch] SkyPilot's plan: not computed here ({local}); SkyPilot picks the cheapest match at launch")
    try:
        answer = input("Launch? [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _local(args, recipe, gpus, user_envs, user_overrides, secrets) -> int:
    import hashlib
    import json

    from orchestrator import records

    if gpus and gpus.name not in (None, accelerators.CPU):
        raise OrchError(f"--gpus {args.gpus}: --local runs CPU processes; use --gpus CPU:{gpus.count}")
    nodes = args.nodes or recipe.num_nodes
    procs = gpus.count if gpus else 1
    envs, trl = dict(user_envs), {}
    if args.smoke:
        from orchestrator import node, smoke

        trl_cfg = node.load_configs({**recipe.envs, **user_envs}, strict=False)[1]  # --env TRL_CONFIG wins
        model_id = user_overrides.get("model_name_or_path") or str(trl_cfg.get("model_name_or_path", ""))
        artifacts = smoke.plan(model_id, recipe.trainer)
        trl = smoke.trl_overrides(artifacts)
        envs.setdefault("GLOBAL_BATCH_SIZE", str(SMOKE_GLOBAL_BATCH))
        envs.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # smoke never touches a hub
        if recipe.envs.get("VLLM_SERVER_NODES", "0") not in ("", "0"):
            envs["VLLM_SERVER_NODES"] = "0"
            print("[orch] smoke: no vLLM on CPU: every node trains and generates with the tiny model itself")
    elif "model_name_or_path" not in user_overrides:
        print("[orch] note: --local without --smoke trains the recipe's real model on this machine's CPU")
    trl.update(user_overrides)
    # The record keeps the recipe's accelerators (it stays a cloud task); the header says what ran locally.
    task = resolve(recipe, nodes=nodes, envs=envs, trl_overrides=trl)
    # Stable for the same resolved task: rerunning a command finds (and resumes from) its checkpoints.
    shape = json.dumps([task, nodes, procs], sort_keys=True)
    run = f"{recipe.name}-{hashlib.sha256(shape.encode()).hexdigest()[:8]}"
    # Checkpoints are keyed by the run id (SKYPILOT_TASK_ID locally), unless the user chose output_dir.
    envs["CHECKPOINT_ROOT"] = "" if "output_dir" in user_overrides else "outputs"
    if recipe.task.get("file_mounts"):
        print("[orch] local: the recipe's file_mounts are not mounted; checkpoints go to outputs/")
    task = resolve(recipe, nodes=nodes, envs=envs, trl_overrides=trl)
    from orchestrator.backends import local

    # The recipe's own consistency (memory is a GPU matter), batch math and env errors, before anything
    # starts: bad input builds no smoke model either.
    check(recipe, task, None, nodes, procs, device="cpu", task_id=run)
    if args.smoke:
        smoke.ensure(artifacts)
    task = _record_secrets(task, secrets)
    record = records.new(
        run,
        task,
        recipe.path,
        redacted_command(args.argv),
        backend=f"local ({nodes} emulated node(s) x {procs} CPU process(es))",
        state="running",
        output_dir=local.output_dir_of(task["envs"], run),
    )
    records.write(record)
    if args.fresh:
        local.forget(task["envs"], run)
    code = local.launch(recipe, task, run, nodes=nodes, procs_per_node=procs, secrets=secrets)
    record.meta["state"] = "succeeded" if code == 0 else f"failed (exit {code})"
    records.write(record)
    return code
