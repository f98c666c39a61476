"""`orch ls`: the recipes, with trainer, strategy, model and default GPUs."""

from __future__ import annotations

import argparse

from orchestrator.commands import add

EPILOG = """\
examples:
  orch ls                                  # every recipe in ./recipes and orch's own
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
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from orchestrator.commands import print_table
    from orchestrator.core.errors import OrchError
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.recipe_info import summarize

    rows = [("RECIPE", "TRAINER", "STRATEGY", "MODEL", "GPUS/NODE", "NODES")]
    for path in recipes.all_recipe_paths():
        try:
            s = summarize(recipes.load(str(path)))
        except OrchError as exc:
            rows.append((path.stem, "?", "?", f"(broken: {exc})", "", ""))
            continue
        rows.append((s.name, s.trainer, s.strategy, s.model, s.gpus, str(s.nodes)))
    print_table(rows)
    return 0
