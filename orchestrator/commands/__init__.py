"""One module per `orch` subcommand, each with `register(subparsers)` and real examples in its epilog."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction, name: str, help: str, description: str, epilog: str):
    """A subcommand parser whose epilog (the examples) keeps its line breaks."""
    return sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
