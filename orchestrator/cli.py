"""The `orch` command. Each subcommand is a small module in orchestrator/commands/ with real examples.

Imports stay light: nothing here pulls torch, transformers, trl or sky; a subcommand imports what it needs
when it runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from orchestrator import __version__
from orchestrator.core.errors import OrchError

# Subcommand -> the module in orchestrator/commands/ that registers it.
COMMANDS = {
    "run": "run", "ls": "ls", "show": "show", "cp": "cp",
    "status": "jobs", "logs": "jobs", "cancel": "jobs", "down": "jobs",
    "node": "node", "dashboard": "dashboard", "plan": "plan", "pull": "pull",
}  # fmt: skip

EPILOG = """\
examples:
  orch run phi3_dpo_fsdp --local --nodes 2 --smoke            # 2 emulated nodes on this machine, CPU, tiny Phi-3
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2 --dry-run    # every rank's command and SkyPilot's plan
  orch run phi3_dpo_fsdp --gpus A100:8 --nodes 2              # launch through the SkyPilot SDK
  orch ls                                                     # the recipes: trainer, strategy, model, GPUs
  orch cp phi3_dpo_fsdp my_dpo                                # an editable copy with its configs
  orch plan meta-llama/Llama-3.1-70B-Instruct --max-length 4096  # which GPUs, how many nodes, $/h
  orch status                                                 # recorded runs and their state
  orch dashboard RUN                                          # a --track run's curves, every node, in Trackio
  orch pull RUN                                               # its final model: from the Hub, local run or cluster
  orch node --print                                           # on a node: the accelerate command it would run

The two sides: `orch run` (laptop/CI) resolves a recipe and launches it; `orch node` (on every node,
from the recipe's `run:`) turns SkyPilot's environment into the exact `accelerate launch` command.
"""


class _Parser(argparse.ArgumentParser):
    """Exact option names only: argparse's prefix matching would take `--se` for `--secret`, a spelling no
    redaction could know. Errors are one line, exit code 2, with a usage hint."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
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


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """One line naming the words argparse left over, a close option name if there is one, and never an option's
    value (`--se=HF_TOKEN=...` may hold a secret)."""
    import difflib

    shown = [w.partition("=")[0] + "=..." if w.startswith("-") and "=" in w else w for w in extra]
    sub = parser._subparsers._group_actions[0].choices.get(command) if command and parser._subparsers else None
    options = list(sub._option_string_actions) if sub else []
    hint = ""
    for word in extra:
        name = word.partition("=")[0]
        prefixed = [o for o in options if o.startswith(name) and name.startswith("--")]
        close = prefixed or (difflib.get_close_matches(name, options, n=1) if word.startswith("-") else [])
        if close:
            hint = f"; did you mean {close[0]}?"
            break
    where = f"{parser.prog} {command} --help" if sub else f"{parser.prog} --help"
    raise OrchError(f"unrecognized arguments: {' '.join(shown)}{hint} (see `{where}`)")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal, a laptop lid, `kill`), handled as Ctrl-C is: whatever orch started is
    stopped and the record says how the run ended."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signame = signal.Signals(signum).name
        self.code = 128 + signum


def _stop(signum, _frame):
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == ["node"]:
            _workdir_orch(argv)
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _stop) for sig in handled}
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _workdir_orch(argv: list[str]) -> None:
    """`orch node` runs the orch of the directory it starts in when that is an orch checkout (the task's workdir,
    which SkyPilot synced), not the copy the node's environment was installed from: an environment shared by
    clusters (ORCH_VENV on a Slurm home) was installed from another cluster's workdir, maybe of another version,
    maybe deleted with its cluster. The process is replaced by `python -m orchestrator node ...`, whose sys.path
    starts with the workdir; the processes it starts (`-m` from the same directory) import from there too."""
    try:
        here = os.getcwd()
    except OSError:  # a directory removed under it: nothing to run from there
        return
    package = os.path.dirname(os.path.abspath(__file__))
    ours = os.path.join(here, "orchestrator")
    if os.environ.get("ORCH_NODE_WORKDIR") == here or not os.path.isfile(os.path.join(ours, "cli.py")):
        return
    if os.path.realpath(ours) == os.path.realpath(package):
        return
    os.environ["ORCH_NODE_WORKDIR"] = here  # once: a Python that never puts the cwd first (-P) runs what it has
    os.execv(sys.executable, [sys.executable, "-m", "orchestrator", *argv])


def _main(argv: list[str]) -> int:
    try:
        parser = build_parser(only=argv[0] if argv else None)
        # key=value words may come after options (`orch run R --nodes 2 lr=1e-5`): argparse leaves those over.
        args, extra = parser.parse_known_args(argv)
        if hasattr(args, "overrides"):
            args.overrides += [w for w in extra if "=" in w and not w.startswith("-")]
            extra = [w for w in extra if not ("=" in w and not w.startswith("-"))]
        if extra:
            _unrecognized(parser, getattr(args, "command", None), extra)
        args.argv = list(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except OrchError as exc:
        print(f"orch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the last net: a full disk, a path orch could not foresee; one line, no traceback
        import errno

        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return 128 + signal.SIGPIPE  # `orch ls | head -1`: the reader has what it wanted, as `yes | head` ends
        where = f" ({exc.filename})" if exc.filename else ""
        if exc.errno == errno.ENOSPC:
            print(f"orch: error: no space left on the device{where}: free some and rerun (a run resumes from "
                  "its last complete checkpoint)", file=sys.stderr)  # fmt: skip
            return 1
        print(f"orch: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        name = getattr(exc, "signame", "SIGINT")
        try:
            print(f"orch: interrupted ({name})", file=sys.stderr)
        except OSError:  # the terminal is gone
            pass
        return getattr(exc, "code", 130)


def _stdout_closed() -> bool:
    """Whether stdout is the pipe whose reader went away (not a pipe orch writes to a process); if so, point it at
    /dev/null so that the interpreter's last flush says nothing either."""
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poll.poll(0))  # a pipe's write end with no reader
    except (OSError, ValueError):  # stdout is no file (a test's capture): not this
        return False
    if closed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return closed


if __name__ == "__main__":
    sys.exit(main())
