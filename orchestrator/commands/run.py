"""`orch run RECIPE`: resolve a recipe with the user's flags and launch it (locally with --local)."""

from __future__ import annotations

import argparse
import hashlib
import json

from orchestrator import accelerators, overrides
from orchestrator.errors import OrchError
from orchestrator.recipe import check_paired_files, load, parse_env_assignments, resolve

EPILOG = """\
examples:
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke          # 2 emulated nodes, CPU, tiny Phi-3, ~30 s
  orch run phi3_dpo_fsdp --local --nodes 1 --gpus CPU:2 --smoke   # 1 node x 2 processes
  orch run recipes/phi3_dpo_fsdp.yaml --local --smoke max_steps=4  # a path works too; key=value overrides TRL

Flags you give override the recipe (for example --nodes beats the recipe's num_nodes); key=value words
override the TRL config. `orch ls` lists the recipes.
"""

SMOKE_GLOBAL_BATCH = 16


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run",
        help="resolve a recipe and launch it",
        description="Resolve a recipe (task YAML + Accelerate + TRL configs) with your flags and launch it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="recipe name (see `orch ls`) or path to a recipe YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TRL arguments; override the TRL config")
    parser.add_argument(
        "--nodes",
        "--num-nodes",
        dest="nodes",
        type=int,
        metavar="N",
        help="number of nodes; overrides the recipe's num_nodes",
    )
    parser.add_argument(
        "--gpus",
        metavar="ACC:N",
        help="accelerators per node, e.g. A100:8; overrides the recipe's. With --local: CPU:N, processes per node",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="set a task env (repeatable); overrides the recipe's envs. `--env K` takes K from your environment",
    )
    parser.add_argument("--local", action="store_true", help="emulate the nodes on this machine (CPU processes)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model of the recipe's architecture + synthetic data, built here with no network; few steps",
    )
    parser.set_defaults(func=main)


def run_id(recipe_name: str, task: dict) -> str:
    """Stable for the same resolved task, so rerunning a local command finds (and resumes) its checkpoints."""
    digest = hashlib.sha256(json.dumps(task, sort_keys=True, default=str).encode()).hexdigest()
    return f"{recipe_name}-{digest[:8]}"


def main(args: argparse.Namespace) -> int:
    import yaml

    recipe = load(args.recipe)
    if args.nodes is not None and args.nodes < 1:
        raise OrchError(f"--nodes {args.nodes}: a run needs at least 1 node")
    gpus = accelerators.parse(args.gpus) if args.gpus else None
    user_envs = parse_env_assignments(args.env)
    user_overrides = overrides.parse(args.overrides)
    check_paired_files(recipe)
    if not args.local:
        raise OrchError("launching on a cloud is not built yet; use --local (see `orch run --help`)")
    if args.smoke is False and "model_name_or_path" not in user_overrides:
        print("[orch] note: --local without --smoke trains the recipe's real model on this machine's CPU")

    nodes = args.nodes or recipe.num_nodes
    procs = gpus.count if gpus else 1
    if gpus and gpus.name not in (None, accelerators.CPU):
        raise OrchError(
            f"--gpus {args.gpus}: --local runs CPU processes; use --gpus CPU:{gpus.count} or --gpus {gpus.count}"
        )
    trl_cfg = yaml.safe_load(recipe.paired("TRL_CONFIG").read_text()) or {}
    envs = dict(user_envs)
    trl = {}
    if args.smoke:
        from orchestrator import smoke

        model_id = user_overrides.get("model_name_or_path") or str(trl_cfg.get("model_name_or_path", ""))
        plan = smoke.plan(model_id, recipe.trainer)
        smoke.ensure(plan)
        trl = smoke.trl_overrides(plan)
        envs.setdefault("GLOBAL_BATCH_SIZE", str(SMOKE_GLOBAL_BATCH))
        envs.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # smoke never touches a hub
    trl.update(user_overrides)
    accel = f"{accelerators.CPU}:{procs}"
    task = resolve(recipe, nodes=nodes, accelerators=accel, envs=envs, trl_overrides=trl)
    rid = run_id(recipe.name, task)
    if "output_dir" not in user_overrides:  # local checkpoints are keyed by the run id
        trl["output_dir"] = f"outputs/{rid}"
        task = resolve(recipe, nodes=nodes, accelerators=accel, envs=envs, trl_overrides=trl)

    from orchestrator.backends import local

    return local.launch(recipe, task, rid, nodes=nodes, procs_per_node=procs)
