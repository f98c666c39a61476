"""A resume_from_checkpoint the user gave (TRL's setting, a path): a checkpoint transformers resumes from, judged
once for a local run's launch side (launch/backends/local_backend.py) and on every rank, where a cloud run's path lies
(train/resumption.py). Without it the ranks stopped after the model loaded on `FileNotFoundError: ...
trainer_state.json`."""

from __future__ import annotations

from pathlib import Path

STATE = "trainer_state.json"


def problem(value: str, path: Path) -> str | None:
    """None where `path` (the setting's `value`, resolved where it is read) holds a checkpoint, else the line."""
    if path.is_dir() and (path / STATE).is_file():
        return None
    what = ("no such directory" if not path.exists() else "not a directory" if not path.is_dir()
            else f"a directory without {STATE}")  # fmt: skip
    return (f"resume_from_checkpoint={value}: {what} ({path}), not a checkpoint transformers resumes from (a "
            f"checkpoint-N directory with {STATE}); orch resumes from output_dir's newest complete checkpoint by "
            "itself: drop resume_from_checkpoint, or give a checkpoint's directory")  # fmt: skip
