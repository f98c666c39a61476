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

    from orchestrator import overrides
    from orchestrator.commands.run import check_trl
    from orchestrator.node import PROFILES, load_configs, resolve_accelerate_config
    from orchestrator.recipe import check_paired_files, load, resolve
    from orchestrator.recipe_info import summarize
    from orchestrator.yamlio import dump_task

    recipe = load(args.recipe)
    check_paired_files(recipe)
    task = resolve(recipe, trl_overrides=overrides.parse(args.overrides))
    _, trl_config, _ = load_configs(task["envs"], strict=False)
    check_trl(recipe, task, trl_config)
    s = summarize(recipe)
    print(f"# {s.name}: {s.trainer}, {s.strategy}, {s.model}, {s.nodes} x {s.gpus} ({recipe.path})")
    print(dump_task(task).rstrip())
    trl_path = recipe.paired("TRL_CONFIG")
    trl = dict(trl_config)
    trl.update(overrides.loads(task["envs"].get("TRL_OVERRIDES", "")))
    print(f"\n# TRL config {trl_path} with TRL_OVERRIDES applied")
    print(yaml.safe_dump(trl, sort_keys=False).rstrip())
    value = recipe.envs["ACCELERATE_CONFIG"]
    accel = resolve_accelerate_config(value, strict=False) if value in PROFILES else recipe.paired("ACCELERATE_CONFIG")
    print(f"\n# Accelerate config {accel}" + (f" (TRL profile {value})" if value in PROFILES else ""))
    print(accel.read_text().rstrip() if accel.is_file() else "(TRL is not installed here: the node resolves it)")
    return 0
