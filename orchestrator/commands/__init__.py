"""One module per `orch` subcommand, each with `register(subparsers)` and real examples in its epilog."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction, name: str, help: str, description: str, epilog: str):
    """A subcommand parser whose epilog (the examples) keeps its line breaks."""
    return sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def print_table(rows: list[tuple]) -> None:
    """Left-aligned columns, two spaces apart; the first row is the header."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
