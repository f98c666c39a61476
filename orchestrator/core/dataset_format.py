"""The columns each TRL trainer reads (TRL's dataset formats, conversational or standard), and the one line that
says what a row lacks: used for --data files (launch/data.py) and the one-row check of a Hub dataset
(rehearsal/data.py)."""

from __future__ import annotations

import json

# Columns each trainer reads (any one set), per TRL's dataset formats, and a row that would do.
NEEDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "sft": (("messages",), ("text",), ("prompt", "completion")),
    "dpo": (("chosen", "rejected"),),
    "reward": (("chosen", "rejected"),),
    "kto": (("prompt", "completion", "label"),),
    "grpo": (("prompt",),),
}
EXAMPLES = {
    "sft": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    "dpo": {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}]},  # fmt: skip
    "kto": {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}],
            "label": True},  # fmt: skip
    "grpo": {"prompt": [{"role": "user", "content": "What is 2+2?"}]},
}
EXAMPLES["reward"] = EXAMPLES["dpo"]


def needs(trainer: str) -> str:
    return " or ".join(" + ".join(s) for s in NEEDS[trainer])


def missing(row: dict, trainer: str) -> str | None:
    """None when the row has the columns the trainer reads, else "has no column X (it has ...); TRL's ..."."""
    if any(set(columns) <= row.keys() for columns in NEEDS[trainer]):
        return None
    best = max(NEEDS[trainer], key=lambda columns: len(set(columns) & row.keys()))
    lacking = [c for c in best if c not in row]
    named = f"column{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}"
    return (
        f"has no {named} (it has {', '.join(sorted(row)) or 'none'}); TRL's {trainer} trainer reads "
        f"{needs(trainer)}, e.g. {json.dumps(EXAMPLES[trainer])}"
    )


def conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)
