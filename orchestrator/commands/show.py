"""`orch show NAME [key=value ...]`: the resolved recipe and its paired configs, overrides applied."""

from __future__ import annotations

import argparse

from orchestrator.commands import add

EPILOG = """\
examples:
  orch show phi3_dpo_fsdp                          # task, TRL config and Accelerate config
  orch show phi3_dpo_fsdp learning_rate=1e-6 beta=0.2   # with TRL overrides, checked against DPOConfig
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "show",
        help="print a recipe resolved with overrides",
        description="Print a recipe with its paired configs, key=value overrides applied.",
        epilog=EPILOG,
    )
    parser.add_argument("recipe", help="recipe name (see `orch ls`) or path")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TRL arguments over the TRL config")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import yaml

    from orchestrator.core import overrides
    from orchestrator.core.configs import PROFILES
    from orchestrator.core.yamlio import dump_task
    from orchestrator.launch.checks import check_trl
    from orchestrator.launch.recipe import check_paired_files, load
    from orchestrator.launch.recipe_info import summarize
    from orchestrator.launch.resolved import resolve

    recipe = load(args.recipe)
    check_paired_files(recipe)
    launch = resolve(recipe, trl_overrides=overrides.parse(args.overrides))
    check_trl(launch)
    s = summarize(recipe)
    print(f"# {s.name}: {s.trainer}, {s.strategy}, {s.model}, {s.nodes} x {s.gpus} ({recipe.path})")
    print(dump_task(launch.task()).rstrip())
    print(f"\n# TRL config {recipe.paired('TRL_CONFIG')} with TRL_OVERRIDES applied")
    print(yaml.safe_dump(dict(launch.settings), sort_keys=False).rstrip())
    value = recipe.envs["ACCELERATE_CONFIG"]
    accel = launch.paired.accelerate_file
    print(f"\n# Accelerate config {accel}" + (f" (TRL profile {value})" if value in PROFILES else ""))
    if value in PROFILES and not accel.is_file():
        print("# (trl is not installed here: TRL's profile as orch's snapshot of it has it)")
        print(yaml.safe_dump(dict(launch.paired.accelerate.raw), sort_keys=False).rstrip())
    else:
        print((recipe.workdir / accel if value not in PROFILES else accel).read_text().rstrip())
    return 0
