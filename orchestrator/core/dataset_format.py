"""What TRL reads from a dataset row, and the one line that says why a row cannot be read (its columns:
core/trainers.py): used for every row of a --data file (launch/data.py) and the one-row check of a Hub dataset
(rehearsal/data.py).

TRL 1.16's trainers pick a row's columns in their own order (SFT: `prompt` + `completion` when the row has a prompt,
else `messages`, else dataset_text_field), read an optional `prompt` in preference pairs (DPO, reward: otherwise
taken from chosen and rejected), and read a row as conversational or standard by one of its columns. A dataset's
format comes from its first row (the EOS that standard rows get is added by it), and datasets gives a row a null where
another row has a column it lacks. So a row must hold its columns in readable types, all strings or all
conversations, and every row of a file the same columns of the same kind as the first: otherwise the ranks stop after
the launch on `'NoneType' object has no attribute 'endswith'` or `You need to specify either text or text_target`.
"""

from __future__ import annotations

import functools
import json

from orchestrator.core import trainers

TEXTUAL = ("prompt", "chosen", "rejected", "completion", "messages")
"""The columns whose kind (a string or a conversation) makes a row conversational for TRL (`is_conversational`)."""
OPTIONAL = {"preference": ("prompt",)}
"""Columns a format's trainers read when the rows have them (a pair's explicit prompt), by TrainerSpec.format."""


def needs(trainer: str) -> str:
    return trainers.spec(trainer).needs()


@functools.cache
def _sets(trainer: str, text_field: str, tried: bool = True) -> tuple[tuple[str, ...], ...]:
    """The trainer's column sets, with SFT's `text` named as dataset_text_field says; `tried`: in the order TRL tries
    them (a prompt first: SFT reads a row with a prompt as prompt + completion), else in the spec's. Asked once per row
    of a --data file: made once."""
    sets = [tuple(text_field if c == "text" else c for c in s) for s in trainers.spec(trainer).columns]
    return tuple(sorted(sets, key=lambda s: s[0] != "prompt") if tried else sets)


def _reads(trainer: str, text_field: str) -> str:
    """What the trainer reads, in words, with a row that would do (the end of every refusal's line)."""
    spec = trainers.spec(trainer)
    optional = "".join(f" (and {c}, where every row has one)" for c in OPTIONAL.get(spec.format, ()))
    listed = " or ".join(" + ".join(s) for s in _sets(trainer, text_field, tried=False))
    return f"{listed}{optional}, e.g. {json.dumps(dict(spec.example))}"


def read(row: dict, trainer: str, text_field: str = "text") -> tuple[str, ...] | None:
    """The columns TRL reads from this row: the first set whose first column the row has (all of them needed), then
    the optional ones it has; None when the row has none of the sets' first columns."""
    chosen = next((s for s in _sets(trainer, text_field) if s[0] in row), None)
    if chosen is None:
        return None
    extra = [c for c in OPTIONAL.get(trainers.spec(trainer).format, ()) if c in row and c not in chosen]
    return (*chosen, *extra)


Shape = tuple[tuple[str, ...], bool]
"""A row's columns TRL reads, in its order (rows with the same columns read them in the same order), and whether it is
conversational: every row of a dataset needs its first row's."""


def missing(row: dict, trainer: str, text_field: str = "text") -> str | None:
    """None when TRL can read the row, else what is wrong (`judge`)."""
    return judge(row, trainer, text_field)[0]


def judge(row: dict, trainer: str, text_field: str = "text") -> tuple[str | None, Shape]:
    """(None when TRL can read the row, else what is wrong: "has no column X (it has ...); TRL's ..." or a column in a
    type TRL cannot read, or strings and conversations mixed in one row; the row's Shape). The line is built only for
    a row that has one: a --data file's every row comes here."""
    sets = _sets(trainer, text_field)
    columns = read(row, trainer, text_field)
    lacking = [c for c in columns or () if c not in row]
    if columns is None or lacking:
        has = f"(it has {', '.join(sorted(row)) or 'none'})"
        if columns is None and not any(set(s) & row.keys() for s in sets):
            field = f"; dataset_text_field=COLUMN reads another column as {text_field}" if (text_field,) in sets else ""
            reads = _reads(trainer, text_field)
            return f"has none of the columns TRL's {trainer} trainer reads {has}; it reads {reads}{field}", ((), False)
        if columns is None:
            best = max(sets, key=lambda s: len(set(s) & row.keys()))
            lacking = [c for c in best if c not in row]
        named = f"column{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}"
        return f"has no {named} {has}; TRL's {trainer} trainer reads {_reads(trainer, text_field)}", ((), False)
    kinds = {c: conversational(row[c]) for c in columns if c in TEXTUAL}
    wrong = next((c for c in columns if not _typed(c, row[c], text_field, kinds.get(c))), None)
    if wrong is not None:
        return unreadable(wrong, row[wrong], trainer, _reads(trainer, text_field)), ((), False)
    if len(set(kinds.values())) > 1:
        chats = [c for c, chat in kinds.items() if chat]
        texts = [c for c, chat in kinds.items() if not chat]
        strings = f"{', '.join(texts)} as {'strings' if len(texts) > 1 else 'a string'}"
        chat = f"{', '.join(chats)} as {'conversations' if len(chats) > 1 else 'a conversation'}"
        example = json.dumps(dict(trainers.spec(trainer).example))
        return (f"has {strings} and {chat}; TRL reads a row as all strings or all "
                f"conversations: give its columns one kind, e.g. {example}"), ((), False)  # fmt: skip
    return None, (columns, any(kinds.values()))


def unreadable(column: str, value, trainer: str, reads: str = "") -> str:
    """The line for a column whose value TRL cannot read (`reads`: what it reads, as `missing` words it)."""
    said = f"has column {column} as {_kind(value)}, which TRL's {trainer} trainer cannot read"
    return f"{said}; it reads {reads}" if reads else said


def unlike(seen: Shape, first: Shape) -> str | None:
    """Why TRL cannot read a row of Shape `seen` in a dataset whose first row's is `first`, or None."""
    (columns, chat), (first_columns, first_chat) = seen, first
    if columns != first_columns:
        now, then = ", ".join(sorted(columns)), ", ".join(sorted(first_columns))
        return (f"has {now} where row 1 has {then}: datasets gives a row a null for a column another row has, which "
                "TRL cannot read; give every row the same columns")  # fmt: skip
    if chat != first_chat:
        kind = {True: "conversations", False: "strings"}
        return (f"holds {kind[chat]} where row 1 holds {kind[first_chat]}: TRL takes a dataset's format from its "
                "first row; give every row the same format")  # fmt: skip
    return None


def _typed(column: str, value, text_field: str = "text", chat: bool | None = None) -> bool:
    """A column's value in a type TRL's trainers read: `messages` a conversation, the text field a string, `label` a
    bool, the rest (prompt, completion, chosen, rejected, ...) a string or a conversation (an empty list is neither:
    TRL's is_conversational reads its first message, IndexError). `chat`: conversational(value), where known."""
    chat = conversational(value) if chat is None and column not in (text_field, "label") else chat
    if column == "messages":  # a list of messages, not empty (TRL's is_conversational reads its first)
        return bool(chat)
    if column == text_field:
        return isinstance(value, str)
    if column == "label":
        return isinstance(value, bool)
    return isinstance(value, str) or bool(chat)


def _kind(value) -> str:
    """A JSON value's type and its start, as a row shows it: `a number (1)`, `null`."""
    if value is None:
        return "null"
    if value == []:
        return "an empty list"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return f"{kind.get(type(value), type(value).__name__)} ({json.dumps(value, default=str)[:60]})"


def conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)
