"""`orch run [RECIPE]`: resolve a recipe with the user's flags, check it, record it in sky_jobs/, launch it."""

from __future__ import annotations

import argparse
import re

from orchestrator.commands import add
from orchestrator.core import knobs, slots
from orchestrator.core.errors import OrchError
from orchestrator.launch.placement import DEFAULT_IDLE_MINUTES, DEFAULT_RESTARTS

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

Before a cloud launch orch rehearses every rank against the training stack, streams one row of the recipe's
dataset and asks the Hub for its attention kernel: what no rank could train with stops the launch here
(ORCH_REHEARSAL, ORCH_DATA_CHECK, ORCH_KERNEL_CHECK=off skip them). Then it shows SkyPilot's choice and its $/h
(and the recipe's cost estimate) and asks; -y skips the question. A managed job, a multi-node run or --down
needs checkpoints on a mounted bucket (CHECKPOINT_ROOT): the nodes' own disks are lost with the cluster.
Several nodes get network_tier: best (InfiniBand/EFA where the cloud has it) unless the recipe sets a tier.
"""



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
        help="set a task env (repeatable), over the recipe's envs; `--env K` takes K from your environment. An ORCH_ "
        "name must be one of orch's knobs (a misspelt one is refused, not dropped)",
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
        "--disk-size",
        type=int,
        metavar="GB",
        help="each node's disk (resources.disk_size; SkyPilot's default 256): it holds the model's download and, "
        "unless they go to a bucket, the checkpoints; a launch whose estimate outgrows it is refused",
    )
    cloud.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_RESTARTS,
        metavar="N",
        help="a managed job's restarts after a failed run, besides preemptions (job_recovery.max_restarts_on_errors; "
        f"default {DEFAULT_RESTARTS}); a retryable failure, exit 75 (a hang, a lost node, a network or NCCL error), "
        "restarts it without counting, until a node fails that way ORCH_STUCK_RETRIES (3) times in a row with no new "
        "step",
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
    cloud.add_argument(
        "--resume",
        metavar="RUN",
        help="relaunch a recorded SkyPilot run as it was recorded (its task, its cluster: reused when up), under the "
        "same run id, so it resumes from its last checkpoint and a reused cluster's setup finds nothing to do; give "
        "no recipe or launch flags, only --secret, -y, --detach, the cluster's --idle-minutes/--down/--keep-up, and "
        "--nodes/--gpus to resume at another shape (on a new cluster, whose --disk-size may be given too; the nodes "
        "reshard the checkpoint)",
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
    local.add_argument(
        "--local",
        dest="platform",
        action="store_const",
        const="local",
        default="sky",
        help="emulate the nodes on this machine (CPU processes); without it: SkyPilot",
    )
    local.add_argument(
        "--fresh",
        action="store_true",
        help="start over: delete this run's earlier checkpoints instead of resuming from them",
    )
    local.add_argument(
        "--auto-fit",
        action="store_true",
        help="on out of memory, retry once with a smaller per-device batch and a longer accumulation (same global "
        "batch); on a cluster, what the memory check refuses before launch runs with the fix it names: the largest "
        "smaller per-device batch that fits (same global batch), a smaller evaluation batch, fewer completions "
        "generated at once",
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
    from orchestrator.core import overrides
    from orchestrator.launch import backends, secrets
    from orchestrator.launch.recipe import check_paired_files, default_name, load
    from orchestrator.launch.resolved import parse_env_assignments

    if args.recipe and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.recipe)  # `orch run lr=1e-5 --local`: a key=value word, no recipe named
        args.recipe = None
    if args.resume is not None:
        return _resume(args)
    name, why = (args.recipe, "") if args.recipe else default_name()
    recipe = load(name)
    if why:
        print(f"[orch] recipe: {recipe.name} ({why}; name another as the first word)", flush=True)
    _check_idle_flags(args)
    if args.cluster is not None:
        slots.check("cluster", args.cluster, "--cluster")
    if args.gpus is not None:
        from orchestrator.core import accelerators

        accelerators.parse(args.gpus)  # a malformed --gpus is refused before anything else
    user_envs = parse_env_assignments(args.env)
    if "ORCH_RUN_ID" in user_envs:
        raise OrchError("--env ORCH_RUN_ID: orch sets it to the run's name, which keys its checkpoints; "
                        "`orch run --resume RUN` relaunches a run under its own")  # fmt: skip
    if args.max_cost is not None:
        knobs.flag("--max-cost", "ORCH_MAX_COST", args.max_cost)
        user_envs["ORCH_MAX_COST"] = args.max_cost
    if args.track:
        user_envs["ORCH_TRACK"] = re.sub(r"[^A-Za-z0-9_-]", "-", recipe.name)[:100]
    user_overrides = overrides.parse(args.overrides)
    secret_values = secrets.values_for(recipe, secrets.parse_secrets(args.secret), smoke=args.smoke)
    if args.push_to_hub:
        knobs.flag("--push-to-hub", "ORCH_PUSH_TO_HUB", args.push_to_hub)
        user_envs["ORCH_PUSH_TO_HUB"] = args.push_to_hub
        if "HF_TOKEN" not in secret_values:
            raise OrchError("--push-to-hub needs a Hub token with write access on the nodes: pass --secret HF_TOKEN")
    from orchestrator.core.overrides import loads

    recipe_overrides = loads(str(recipe.envs.get("TRL_OVERRIDES", "")))
    secrets.check_unwritten({**{f"{recipe.path}: envs.{k}": str(v) for k, v in recipe.envs.items()},
                             **{f"override {k}= (the recipe's TRL_OVERRIDES)": v for k, v in recipe_overrides.items()},
                             **{f"--env {k}": v for k, v in user_envs.items()},
                             **{f"override {k}=": v for k, v in user_overrides.items()}}, secret_values)  # fmt: skip
    check_paired_files(recipe)
    request = backends.RunRequest(recipe, backends.RunOptions.from_args(args), user_envs, user_overrides,
                                  secret_values, args.data)  # fmt: skip
    return backends.get(args.platform).run(request)


def _check_idle_flags(args: argparse.Namespace) -> None:
    """--keep-up, --down and --idle-minutes, for a launch and a relaunch alike."""
    if args.keep_up and (args.down or args.idle_minutes is not None):
        raise OrchError("--keep-up keeps the cluster up: it does not go with --down or --idle-minutes")
    if args.idle_minutes is not None and args.idle_minutes < 0:
        raise OrchError(f"--idle-minutes {args.idle_minutes}: give 0 or more minutes")


# What a relaunch takes from the command line; everything else comes from the run's record.
_RESUME_KEEPS = {"resume", "secret", "yes", "detach", "idle_minutes", "down", "keep_up", "func", "command", "argv",
                 "nodes", "gpus", "disk_size"}  # fmt: skip


def _resume(args: argparse.Namespace) -> int:
    from orchestrator.launch import backends, records, secrets

    defaults = build_parser_defaults()
    given = sorted(name for name, value in vars(args).items()
                   if name not in _RESUME_KEEPS and value != defaults.get(name))  # fmt: skip
    if given:
        words = {"recipe": "the recipe", "overrides": "key=value words", "platform": "--local"}
        flags = ", ".join(words.get(n, "--" + n.replace("_", "-")) for n in given)
        raise OrchError(f"--resume {args.resume} relaunches the run as it was recorded: drop {flags} (to change it, "
                        "launch a new run)")  # fmt: skip
    _check_idle_flags(args)
    record = records.find(args.resume, exact=True)
    backend = backends.for_record(record)
    resume = getattr(backend, "resume", None)
    if resume is None:
        raise OrchError(f"run {record.run} ran on {record.platform}: it resumes by running its command again "
                        f"({record.get('command') or 'orch run ...'})")  # fmt: skip
    return resume(record, backends.RunOptions.from_args(args), secrets.parse_secrets(args.secret))


def build_parser_defaults() -> dict:
    """`orch run`'s defaults, from its own parser (what a flag left out is)."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return vars(parser.parse_args(["run"]))
