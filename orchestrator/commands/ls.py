"""`orch ls`: the recipes, with trainer, strategy, model and default GPUs; `--trainers`: the TRL trainers orch runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.commands import add

EPILOG = """\
examples:
  orch ls                                  # every recipe in ./recipes and orch's own
  orch ls --trainers                       # the TRL trainers a recipe's TRL_TRAINER may name
  orch cp qwen25_sft_ddp my_sft            # start your own from the closest one
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "ls",
        help="list the recipes",
        description="List the recipes.",
        epilog=EPILOG,
    )
    parser.add_argument("--trainers", action="store_true", help="list the TRL trainers orch runs instead")
    parser.set_defaults(func=main)


def trainers() -> int:
    from orchestrator.commands import print_table
    from orchestrator.core.trainers import SPECS

    rows = [("TRAINER", "TRL CLASS", "DATASET COLUMNS", "REFERENCE MODEL", "GENERATES")]
    for spec in SPECS.values():
        reference = {"none": "-", "always": "yes (not with PEFT)", "beta": f"when beta != 0 (TRL: {spec.beta_default})"}
        generates = "yes: reward functions score them" if spec.generates else "-"
        rows.append((spec.name, spec.trl_class, spec.needs(), reference[spec.reference], generates))
    print_table(rows)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.trainers:
        return trainers()
    from orchestrator.commands import print_table
    from orchestrator.core.errors import OrchError
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.recipe_info import summarize

    rows = [("RECIPE", "TRAINER", "STRATEGY", "MODEL", "GPUS/NODE", "NODES")]
    own = recipes.REPO_RECIPES.resolve()
    elsewhere = Path("recipes").resolve() != own  # orch's own recipes name their files relative to orch's root
    from_own = 0
    for path in recipes.all_recipe_paths():
        root = own.parent if elsewhere and recipes.is_own(path) else None
        from_own += root is not None
        try:
            s = summarize(recipes.load(str(path)), root)
        except OrchError as exc:
            rows.append((path.stem, "?", "?", f"(broken: {exc})", "", ""))
            continue
        rows.append((s.name, s.trainer, s.strategy, s.model, s.gpus, str(s.nodes)))
    print_table(rows)
    if from_own:
        print(f"\n{from_own} of these are orch's own, in {own}: run or copy them from {own.parent} (their files and "
              "scripts/node-setup.sh are relative to it)")
    return 0
