"""How many of the training split's rows TRL's trainer kept, read back on every rank.

TRL 1.16's trainers leave rows out of the training split as they prepare it, without a word (`drops` in
core/trainers.py: DPO and KTO a row whose prompt alone fills max_length, the reward trainer a pair longer than it,
SFT a row that truncation leaves nothing to learn from). A run that lost every row stopped after the model loaded on
torch's `num_samples should be a positive integer value, but got num_samples=0`; one that lost most of them said
nothing. Each rank counts the split before the trainer is built and after; rank 0 says how many were left out and
why, the rank's report keeps both counts, and a split left empty ends the rank with the setting to change. Not for a
streamed split (no length) nor with SFT's packing (its rows are packed sequences, not the dataset's rows).
"""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core import trainers


def count(dataset) -> int | None:
    """The rows of a map-style dataset; None for a streamed one (an IterableDataset has no length)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def judge(trainer_name: str, given: int | None, kept: int | None, args) -> dict | None:
    """{given, kept[, why]} of the training split, None where it cannot be told; a ValueError for an empty one."""
    if given is None or kept is None or getattr(args, "packing", False):
        return None
    if kept >= given:
        return {"given": given, "kept": kept}
    drops = trainers.spec(trainer_name).drops or "rows it cannot use"
    why = drops.format(max_length=args.max_length, truncation_mode=getattr(args, "truncation_mode", "keep_start"))
    if kept == 0:
        raise ValueError(f"TRL's {trainer_name} trainer kept none of the {given:,} training rows: it drops {why}; "
                         "raise max_length, or give shorter rows")  # fmt: skip
    return {"given": given, "kept": kept, "why": why}


def line(trainer_name: str, facts: Mapping | None) -> str | None:
    """Rank 0's line where TRL left rows out, else None."""
    if not facts or "why" not in facts:
        return None
    given, kept = facts["given"], facts["kept"]
    return (f"[orch] data: TRL's {trainer_name} trainer kept {kept:,} of {given:,} training rows ({given - kept:,} "
            f"left out, {(given - kept) / given:.0%}): it drops {facts['why']}")  # fmt: skip


def read_back(trainer_name: str, trainer, main: bool) -> None:
    """On every rank after the trainer is built (train/entry.py counted the split before, `orch_rows_given`): the
    counts kept for the rank's report (`orch_rows`), rank 0's line, the error of an empty split."""
    given = getattr(trainer, "orch_rows_given", None)
    trainer.orch_rows = judge(trainer_name, given, count(trainer.train_dataset), trainer.args)
    said = line(trainer_name, trainer.orch_rows)
    if main and said:
        print(said, flush=True)
