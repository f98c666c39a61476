"""TRL as data: each trainer's arguments and TRL's Accelerate profiles, for checks that need no trl installed.

`trl_args.json` beside this file is generated from TRL's own parsers and its `accelerate_configs/` folder
(`python -m orchestrator.train.snapshots`, which imports trl) and committed, so the launch side checks names
and types without importing trl, and reads a profile like `zero1` where trl is absent; a test regenerates it
and fails when the installed TRL disagrees. It records the trl / transformers / accelerate versions it came
from, which pyproject.toml pins for the nodes (a test compares them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.core.errors import OrchError, did_you_mean

SCHEMA = Path(__file__).parent / "trl_args.json"
TRAINER_CLASSES = {
    "sft": "SFTTrainer",
    "dpo": "DPOTrainer",
    "grpo": "GRPOTrainer",
    "kto": "KTOTrainer",
    "reward": "RewardTrainer",
}
"""The TRL trainers orch runs: name (trl.scripts.<name>) -> the trainer class in trl."""
TRAINERS = tuple(TRAINER_CLASSES)
_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}
CONFIG_ONLY_KEYS = {"env"}  # TrlParser reads `env:` from a config file and exports it


@cache
def _schema() -> dict:
    return json.loads(SCHEMA.read_text())


def versions() -> dict[str, str]:
    """The trl / transformers / accelerate versions the argument lists were generated from."""
    return _schema()["versions"]


def profiles() -> dict[str, dict]:
    """TRL's Accelerate profiles (trl/accelerate_configs/<name>.yaml) as they were when the snapshot was made."""
    return _schema()["profiles"]


def check_trainer(trainer: str) -> str:
    """A TRL_TRAINER value orch runs, or one clear error."""
    if trainer not in TRAINERS:
        raise OrchError(f"TRL_TRAINER={trainer!r} is not a trainer orch runs; use one of {', '.join(TRAINERS)}")
    return trainer


def fields(trainer: str) -> dict[str, object]:
    return _schema()[check_trainer(trainer)]


def _stack() -> str:
    v = versions()
    return f"TRL {v['trl']} / transformers {v['transformers']}, the versions the nodes install"


def _kind_ok(kind: object, value: str) -> bool:
    text = value.strip()
    if isinstance(kind, list):  # choices
        return text in [str(c) for c in kind] or (text in ("None", "none") and None in kind)
    if text in ("None", "none", "null") and kind not in ("bool",):
        return True  # Optional fields take None; TRL's own parser decides for the rest
    try:
        if kind == "int":
            int(text)
        elif kind == "float":
            float(text)
        elif kind == "bool":
            return text.lower() in _TRUE | _FALSE
    except ValueError:
        return False
    return True


def _describe(kind: object) -> str:
    if isinstance(kind, list):
        return f"one of {', '.join(map(str, kind))}"
    return {"int": "an integer", "float": "a number", "bool": "true or false"}.get(str(kind), f"a {kind}")


def check(trainer: str, overrides: Mapping[str, str], source: str = "override") -> None:
    """Unknown names and values of the wrong type are one-line errors with a suggestion."""
    known = fields(trainer)
    for key, value in overrides.items():
        if key not in known:
            hint = did_you_mean(key, known, cutoff=0.6)
            raise OrchError(
                f"{source} {key}={value}: {trainer} has no TRL argument {key!r}; {hint}"
                f"`trl {trainer} --help` lists them ({_stack()})"
            )
        if not _kind_ok(known[key], str(value)):
            raise OrchError(f"{source} {key}={value}: {key} takes {_describe(known[key])}")


def check_config_keys(trainer: str, config: Mapping, path: str) -> None:
    """Keys of a TRL config file exist for its trainer (values are left to TRL's parser on the node)."""
    known = fields(trainer)
    for key in config:
        if key not in known and key not in CONFIG_ONLY_KEYS:
            hint = did_you_mean(str(key), known, cutoff=0.6)
            raise OrchError(f"TRL config {path}: {trainer} has no argument {key!r}; {hint}({_stack()})")


def is_list(trainer: str, key: str) -> bool:
    return fields(trainer).get(key) == "list"


def render(schema: dict) -> str:
    lines = ["{"]
    for i, (trainer, names) in enumerate(schema.items()):
        lines.append(f"  {json.dumps(trainer)}: {{")
        items = list(names.items())
        for j, (name, kind) in enumerate(items):
            lines.append(f"    {json.dumps(name)}: {json.dumps(kind)}" + ("," if j < len(items) - 1 else ""))
        lines.append("  }" + ("," if i < len(schema) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"
