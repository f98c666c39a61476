"""`orch run [RECIPE]`: resolve a recipe with the user's flags, check it, record it in sky_jobs/, launch it."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import TYPE_CHECKING

from orchestrator.commands import add
from orchestrator.core.errors import OrchError

if TYPE_CHECKING:  # imported where they run: `orch --help` and the other subcommands never load the launch side
    from orchestrator.launch.resolved import Launch

EPILOG = """\
examples:
  orch run --gpus A100:8 --nodes 2                            # the repository's default recipe (it says which)
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2              # cluster launch through the SkyPilot SDK
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2 --dry-run    # resolved task, every rank's command, plan, $/h
  orch run llama3_sft_fsdp --managed --spot --secret HF_TOKEN # managed job: SkyPilot recovers preemptions
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke            # 2 emulated nodes, CPU, tiny Phi-3
  orch run phi3_dpo_fsdp --local --nodes 1 --gpus CPU:2 --smoke max_steps=4   # key=value overrides TRL
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke --netns    # root: each node in its own network namespace
  orch run phi3_dpo_fsdp --gpus H100:8 --nodes 2 --max-cost 250  # stop cleanly before $250 are spent
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke --track    # curves in Trackio; then: orch dashboard RUN
  orch run qwen25_sft_ddp --data ./my.jsonl --gpus H100:8      # your rows (checked here first), uploaded with the task

Which side wins: flags you give override the recipe (--gpus beats resources.accelerators, --nodes beats
num_nodes, --env beats envs); key=value words override the TRL config. Every run is recorded as
sky_jobs/<run>.yaml, which `sky launch sky_jobs/<run>.yaml` relaunches. `orch ls` lists the recipes.

Before a cloud launch orch shows SkyPilot's choice and its $/h (and the recipe's cost estimate) and asks;
-y skips the question. A managed job, a multi-node run or --down needs checkpoints on a mounted bucket
(CHECKPOINT_ROOT): the nodes' own disks are lost with the cluster. Several nodes get network_tier: best
(InfiniBand/EFA where the cloud has it) unless the recipe sets a tier.
"""

DEFAULT_RESTARTS = 3  # launch/placement.py: job_recovery.max_restarts_on_errors
DEFAULT_IDLE_MINUTES = 10  # a cluster `orch run` launched stops by itself: no idle GPUs on the bill
_CLUSTER = re.compile(r"^[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$")


def register(sub: argparse._SubParsersAction) -> None:
    p = add(
        sub,
        "run",
        help="resolve a recipe and launch it (SkyPilot, or --local)",
        description="Resolve a recipe (task YAML + Accelerate + TRL configs) with your flags, check it and launch it.",
        epilog=EPILOG,
    )
    p.add_argument(
        "recipe",
        nargs="?",
        help="recipe name (see `orch ls`) or path to a recipe YAML; default: ORCH_RECIPE, else [tool.orch] recipe "
        "in ./pyproject.toml, else phi3_dpo_fsdp",
    )
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
    p.add_argument(
        "--max-cost",
        metavar="DOLLARS",
        help="stop the run cleanly, after a final checkpoint, before its spend crosses DOLLARS (needs the cluster's "
        "price: SkyPilot's plan on a cloud, ORCH_PRICE_PER_HOUR otherwise); a launch whose estimate exceeds it is "
        "refused. Same as --env ORCH_MAX_COST=DOLLARS",
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        help="train on your own JSON Lines or Parquet file in the trainer's format: checked here first (every row's "
        "columns), uploaded with the task, read by TRL; with --smoke a sample of its first 128 rows",
    )
    p.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="at the end, upload the final model (weights or LoRA adapter, config, tokenizer) to this private Hugging "
        "Face repo; needs --secret HF_TOKEN with write access, checked before training. Same as --env "
        "ORCH_PUSH_TO_HUB=REPO; `orch pull RUN` fetches it",
    )
    p.add_argument(
        "--track",
        action="store_true",
        help="log curves to Trackio (TRL's recommended tracker, local-first): each node writes its own database, "
        "copied next to the checkpoints; `orch dashboard RUN` merges and shows them. Project: the recipe's name. Same "
        "as --env ORCH_TRACK=<project>",
    )
    cloud = p.add_argument_group("SkyPilot launch (without --local)")
    cloud.add_argument(
        "--managed", action="store_true", help="launch as a managed job (sky jobs launch): relaunched after preemption"
    )
    cloud.add_argument(
        "--spot", "--use-spot", dest="spot", action="store_true", help="use spot instances (resources.use_spot)"
    )
    cloud.add_argument(
        "--infra",
        metavar="INFRA",
        help="where SkyPilot may place it (resources.infra): aws, aws/us-east-1, k8s, k8s/<context>, "
        "slurm/<cluster>/<partition>...",
    )
    cloud.add_argument(
        "--network-tier",
        choices=("best", "standard"),
        help="resources.network_tier (default: best for several nodes: InfiniBand/EFA where the cloud has it)",
    )
    cloud.add_argument("--image-id", metavar="IMAGE", help="resources.image_id (an AMI, docker:<image>, ...)")
    cloud.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_RESTARTS,
        metavar="N",
        help="a managed job's restarts after a retryable failure, exit 75 (a hang, a lost node, a network or NCCL "
        f"error), besides preemptions (job_recovery.max_restarts_on_errors; default {DEFAULT_RESTARTS})",
    )
    cloud.add_argument("--cluster", metavar="NAME", help="cluster name (default: the run name)")
    cloud.add_argument("--idle-minutes", type=int, metavar="M", help="autostop the cluster after M idle minutes")
    cloud.add_argument("--down", action="store_true", help="tear the cluster down when the job finishes")
    cloud.add_argument(
        "--keep-up",
        action="store_true",
        help=f"no autostop: keep the cluster up after the job (by default it stops after {DEFAULT_IDLE_MINUTES} idle "
        "minutes)",
    )
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
    cloud.add_argument(
        "--no-rehearsal",
        action="store_true",
        help="do not rehearse the launch against accelerate/TRL/transformers here (the head node still does, in "
        "its setup); also ORCH_REHEARSAL=off",
    )
    local = p.add_argument_group("local emulation")
    local.add_argument("--local", action="store_true", help="emulate the nodes on this machine (CPU processes)")
    local.add_argument(
        "--fresh",
        action="store_true",
        help="start over: delete this run's earlier checkpoints instead of resuming from them",
    )
    local.add_argument(
        "--auto-fit",
        action="store_true",
        help="on out of memory, retry once with the per-device batch halved and accumulation doubled (same global "
        "batch)",
    )
    local.add_argument(
        "--netns",
        action="store_true",
        help="each emulated node in its own network namespace with its own address on a virtual bridge (root "
        "only): the head address, ports, the barrier and gloo then travel a real (virtual) network",
    )
    local.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model of the recipe's architecture + synthetic data, built here offline; 8 steps",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from orchestrator.core import accelerators, overrides
    from orchestrator.core.accelerators import CPU, Gpus
    from orchestrator.launch import secrets
    from orchestrator.launch.recipe import check_paired_files, default_name, load
    from orchestrator.launch.resolved import parse_env_assignments, resolve

    if args.recipe and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.recipe)  # `orch run lr=1e-5 --local`: a key=value word, no recipe named
        args.recipe = None
    name, why = (args.recipe, "") if args.recipe else default_name()
    recipe = load(name)
    if why:
        print(f"[orch] recipe: {recipe.name} ({why}; name another as the first word)", flush=True)
    if args.keep_up and (args.down or args.idle_minutes is not None):
        raise OrchError("--keep-up keeps the cluster up: it does not go with --down or --idle-minutes")
    if args.idle_minutes is not None and args.idle_minutes < 0:
        raise OrchError(f"--idle-minutes {args.idle_minutes}: give 0 or more minutes")
    if args.cluster and not _CLUSTER.match(args.cluster):
        raise OrchError(f"--cluster {args.cluster!r}: use letters, digits, '-', '_' or '.', starting with a letter")
    gpus = accelerators.parse(args.gpus) if args.gpus is not None else None
    user_envs = parse_env_assignments(args.env)
    if args.max_cost is not None:
        user_envs["ORCH_MAX_COST"] = args.max_cost  # parsed with the other knobs by plan()
    if args.track:
        user_envs["ORCH_TRACK"] = re.sub(r"[^A-Za-z0-9_-]", "-", recipe.name)[:100]
    user_overrides = overrides.parse(args.overrides)
    data_file = None
    if args.data:
        from orchestrator.launch import data

        data_file = data.use(args.data, recipe.trainer, args.local, args.smoke, user_overrides)
    secret_values = secrets.values_for(recipe, secrets.parse_secrets(args.secret), smoke=args.smoke)
    if args.push_to_hub:
        user_envs["ORCH_PUSH_TO_HUB"] = args.push_to_hub  # checked with the other knobs by plan()
        if "HF_TOKEN" not in secret_values:
            raise OrchError("--push-to-hub needs a Hub token with write access on the nodes: pass --secret HF_TOKEN")
    check_paired_files(recipe)
    if args.local:
        if (args.managed or args.spot or args.cluster or args.dry_run or args.detach or args.keep_up or args.infra
                or args.network_tier or args.image_id):  # fmt: skip
            raise OrchError(
                "--managed, --spot, --cluster, --detach, --dry-run, --infra, --network-tier and --image-id are for "
                "SkyPilot launches, not --local"
            )
        if gpus and gpus.name not in (None, CPU):
            raise OrchError(f"--gpus {args.gpus}: --local runs CPU processes; use --gpus CPU:{gpus.count}")
        local_gpus = Gpus(CPU, gpus.count if gpus else 1)
        launch = resolve(recipe, nodes=args.nodes, gpus=local_gpus, envs=user_envs, trl_overrides=user_overrides,
                         secrets=secret_values)  # fmt: skip
        from orchestrator.commands import run_local

        return run_local.run(args, launch, user_envs, user_overrides, secret_values)
    if args.smoke or args.fresh or args.netns or args.auto_fit:
        raise OrchError("--smoke, --fresh, --netns and --auto-fit are for runs on this machine: add --local")
    if gpus and gpus.name == CPU:
        raise OrchError(f"--gpus {args.gpus}: CPU processes are for --local; on a cloud give a GPU, e.g. A100:8")
    launch = resolve(recipe, nodes=args.nodes, gpus=gpus, envs=user_envs, trl_overrides=user_overrides,
                     secrets=secret_values)  # fmt: skip
    if launch.gpus is None or launch.gpus.name is None:
        example = f"--gpus A100:{gpus.count}" if gpus else "--gpus A100:8"
        raise OrchError(f"the recipe names no accelerator in resources.accelerators; give one, e.g. {example}")
    return _cloud(args, launch, user_envs, secret_values, data_file)


def _cloud(args, launch: Launch, user_envs: dict[str, str], secret_values: dict[str, str], data_file=None) -> int:
    from orchestrator.launch import placement, records, secrets, storage
    from orchestrator.launch.checks import check, rehearse

    launch = launch.replace(resources=placement.resources(args, launch))
    bucket, note = launch.envs.get("CHECKPOINT_BUCKET", ""), ""
    if "CHECKPOINT_BUCKET" not in user_envs and storage.shipped_bucket(bucket):
        mine = storage.personal_bucket(launch.recipe.name, storage.user_id())
        launch = launch.replace(envs={**launch.envs, "CHECKPOINT_BUCKET": mine})
        note = (
            f"[orch] checkpoints: bucket {mine} (the recipe's {bucket} is a name anyone may hold; this one is yours "
            "and the recipe's; --env CHECKPOINT_BUCKET=NAME chooses another)"
        )
    # Batch math, parallelism, memory and env errors surface here, before anything is sent.
    checked = check(launch)
    task = launch.task()
    if data_file is not None:
        from orchestrator.launch import data

        data.mount(task, data_file)
    if args.managed or args.spot:
        placement.preemption_hook(task)
    nodes = launch.nodes
    reasons = {"a managed job's recovery": args.managed, f"a run on {nodes} nodes": nodes > 1, "--down": args.down}
    if any(reasons.values()):
        storage.require_durable(task, [why for why, applies in reasons.items() if applies])
    run = f"{launch.recipe.name.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    cluster = args.cluster or run
    if not args.dry_run and not args.yes and not sys.stdin.isatty():
        raise OrchError("a cloud launch asks before it spends money, but stdin is not a terminal: pass -y to launch")
    if args.no_rehearsal or os.environ.get("ORCH_REHEARSAL", "").lower() in ("off", "0", "no"):
        rehearsal = "rehearsal: skipped here (--no-rehearsal); the head node rehearses in its setup"
    else:
        rehearsal = rehearse(launch, checked)  # an OrchError naming role, owner and fix stops here
    if args.dry_run:
        from orchestrator.launch import dryrun

        if note:
            print(note, flush=True)
        return dryrun.show(launch, task, checked, args.skip_optimizer, rehearsal)
    if note:
        print(note, flush=True)
    print(f"[orch] {rehearsal}", flush=True)
    from orchestrator.launch.backends import sky as sky_backend

    sky_backend.to_task(task, secret_values)  # SkyPilot's own validation, before anything is asked or written
    from orchestrator.launch.dryrun import confirm

    if not args.yes and not confirm(launch, task, checked.plans, args.managed):
        print("[orch] not launched", flush=True)
        return 1
    if task["envs"].get("ORCH_MAX_COST") and not task["envs"].get("ORCH_PRICE_PER_HOUR"):
        placement.price(task, checked.plans[0].topology.total_gpus)
    record = records.new(
        run,
        task,
        launch.recipe.path,
        secrets.redacted_command(args.argv, secret_values.values()),
        backend=sky_backend.BACKEND_MANAGED if args.managed else sky_backend.BACKEND_CLUSTER,
        cluster="" if args.managed else cluster,
        state="launching",
    )
    path = records.write(record)
    print(
        f"[orch] run {run}: {launch.recipe.name} on {nodes} x {launch.gpus}{' (spot)' if args.spot else ''}, "
        f"{'managed job' if args.managed else f'cluster {cluster}'}; recorded in {path}",
        flush=True,
    )

    idle = args.idle_minutes
    if not args.managed:  # SkyPilot owns a managed job's cluster and ends it with the job
        if idle is None and not args.down and not args.keep_up:
            idle = DEFAULT_IDLE_MINUTES
        if args.down:
            after = f"after {idle} idle minutes" if idle is not None else "when the job ends"
            print(f"[orch] cluster {cluster}: torn down {after} (--down)", flush=True)
        elif idle is not None:
            print(f"[orch] cluster {cluster}: stops by itself after {idle} idle minutes (autostop; --down tears it "
                  "down instead, --keep-up keeps it up)", flush=True)  # fmt: skip
        else:
            print(f"[orch] cluster {cluster}: kept up after the job (--keep-up): `orch down {run}` ends it", flush=True)

    def submitted(meta: dict) -> None:
        record.meta.update(meta)
        records.write(record)
        print(f"[orch] submitted: {', '.join(f'{k}={v}' for k, v in meta.items() if v)}", flush=True)

    try:
        return sky_backend.launch(
            task,
            secret_values,
            run=run,
            managed=args.managed,
            cluster=cluster,
            idle_minutes=idle,
            down=args.down,
            detach=args.detach,
            on_submitted=submitted,
        )
    except OrchError as exc:
        if record.get("state") == "launching":  # never submitted: the record says why
            record.meta.update(state="failed to launch", error=str(exc))
            records.write(record)
        raise
    except KeyboardInterrupt:
        if record.get("state") == "launching":
            record.meta["state"] = "interrupted while launching"
            records.write(record)
            print(
                f"[orch] interrupted before SkyPilot answered: the request may still provision; `orch status` and "
                f"`sky status` show it, `orch down {run}` tears it down",
                flush=True,
            )
        raise
