"""The `orch` command. Each subcommand is a small module in orchestrator/commands/ with real examples.

Imports stay light: nothing here pulls torch, transformers, trl or sky; a subcommand imports what it needs
when it runs.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator import __version__
from orchestrator.core.errors import OrchError

# Subcommand -> the module in orchestrator/commands/ that registers it.
COMMANDS = {
    "run": "run", "ls": "ls", "show": "show", "cp": "cp",
    "status": "jobs", "logs": "jobs", "cancel": "jobs", "down": "jobs",
    "node": "node",
}  # fmt: skip

EPILOG = """\
examples:
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke            # 2 emulated nodes on this machine, CPU, tiny Phi-3
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2 --dry-run    # every rank's command and SkyPilot's plan
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2              # launch through the SkyPilot SDK
  orch ls                                                     # the recipes: trainer, strategy, model, GPUs
  orch cp phi3_dpo_fsdp my_dpo                                # an editable copy with its configs
  orch status                                                 # recorded runs and their state
  orch node --print                                           # on a node: the accelerate command it would run

The two sides: `orch run` (laptop/CI) resolves a recipe and launches it; `orch node` (on every node,
from the recipe's `run:`) turns SkyPilot's environment into the exact `accelerate launch` command.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2, usage hint
        raise OrchError(f"{message} (see `{self.prog} --help`)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `orch` parser. With `only`, just that subcommand's module is imported (a node starts faster)."""
    import importlib

    parser = _Parser(
        prog="orch",
        description="Run TRL fine-tuning recipes on multi-node GPU clusters through SkyPilot, or locally.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"orch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = [COMMANDS[only]] if only in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module in modules:
        importlib.import_module(f"orchestrator.commands.{module}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(only=argv[0] if argv else None)
        # key=value words may come after options (`orch run R --nodes 2 lr=1e-5`): argparse leaves those over.
        args, extra = parser.parse_known_args(argv)
        if hasattr(args, "overrides"):
            args.overrides += [w for w in extra if "=" in w and not w.startswith("-")]
            extra = [w for w in extra if not ("=" in w and not w.startswith("-"))]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv = list(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except OrchError as exc:
        print(f"orch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("orch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
