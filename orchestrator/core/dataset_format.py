"""The one line that says what a row lacks for a trainer (its columns: core/trainers.py): used for --data files
(launch/data.py) and the one-row check of a Hub dataset (rehearsal/data.py)."""

from __future__ import annotations

import json

from orchestrator.core import trainers


def needs(trainer: str) -> str:
    return trainers.spec(trainer).needs()


def missing(row: dict, trainer: str) -> str | None:
    """None when the row has the columns the trainer reads, else "has no column X (it has ...); TRL's ..."."""
    spec = trainers.spec(trainer)
    if any(set(columns) <= row.keys() for columns in spec.columns):
        return None
    best = max(spec.columns, key=lambda columns: len(set(columns) & row.keys()))
    lacking = [c for c in best if c not in row]
    named = f"column{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}"
    return (
        f"has no {named} (it has {', '.join(sorted(row)) or 'none'}); TRL's {trainer} trainer reads "
        f"{spec.needs()}, e.g. {json.dumps(dict(spec.example))}"
    )


def conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)
