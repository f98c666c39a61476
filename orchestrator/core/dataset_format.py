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
    for columns in spec.columns:
        if set(columns) <= row.keys():
            wrong = next((c for c in columns if not _typed(c, row[c])), None)
            if wrong is None:
                return None
            shown = json.dumps(row[wrong])[:60]
            return (f"has column {wrong} as {type(row[wrong]).__name__} {shown}, which TRL's {trainer} trainer cannot "
                    f"read; it reads {spec.needs()}, e.g. {json.dumps(dict(spec.example))}")  # fmt: skip
    best = max(spec.columns, key=lambda columns: len(set(columns) & row.keys()))
    lacking = [c for c in best if c not in row]
    named = f"column{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}"
    return (
        f"has no {named} (it has {', '.join(sorted(row)) or 'none'}); TRL's {trainer} trainer reads "
        f"{spec.needs()}, e.g. {json.dumps(dict(spec.example))}"
    )


def _typed(column: str, value) -> bool:
    """A column's value in a type TRL's trainers read: `messages` a conversation, `text` a string, `label` a bool,
    the rest (prompt, completion, chosen, rejected, ...) a string or a conversation."""
    if column == "messages":  # a list of messages (an empty one is TRL's to judge)
        return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
    if column == "text":
        return isinstance(value, str)
    if column == "label":
        return isinstance(value, bool)
    return isinstance(value, str) or conversational(value)


def conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)
