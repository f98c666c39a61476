"""TRL's arguments per trainer, as data the launch side can check `key=value` overrides against.

`trl_args.json` beside this file is generated from TRL's own parsers (`python -m orchestrator.trl_schema`,
which imports trl) and committed, so the launch side checks names and types without importing trl; a test
regenerates it and fails when the installed TRL disagrees. It records the trl / transformers / accelerate
versions it came from, which pyproject.toml pins for the nodes (a test compares them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.errors import OrchError, closest

SCHEMA = Path(__file__).parent / "trl_args.json"
TRAINERS = ("sft", "dpo", "grpo", "kto", "reward")
_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}
CONFIG_ONLY_KEYS = {"env"}  # TrlParser reads `env:` from a config file and exports it


@cache
def _schema() -> dict:
    return json.loads(SCHEMA.read_text())


def versions() -> dict[str, str]:
    """The trl / transformers / accelerate versions the argument lists were generated from."""
    return _schema()["versions"]


def fields(trainer: str) -> dict[str, object]:
    schema = _schema()
    if trainer not in TRAINERS:
        raise OrchError(f"no TRL argument list for trainer {trainer!r}; use one of {', '.join(TRAINERS)}")
    return schema[trainer]


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
            close = closest(key, known, cutoff=0.6)
            hint = f"did you mean {close}? " if close else ""
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
            close = closest(str(key), known, cutoff=0.6)
            hint = f"; did you mean {close}?" if close else ""
            raise OrchError(f"TRL config {path}: {trainer} has no argument {key!r}{hint} ({_stack()})")


def is_list(trainer: str, key: str) -> bool:
    return fields(trainer).get(key) == "list"


# ---------------------------------------------------------------- generation (imports trl)


def _kind(tp) -> object:
    import enum
    import types
    import typing

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        kinds = [_kind(a) for a in args]
        if "list" in kinds:
            return "list"
        for preferred in ("bool", "int", "float"):
            if kinds == [preferred]:
                return preferred
        choices = [k for k in kinds if isinstance(k, list)]
        if len(kinds) == 1 and choices:
            return choices[0] + [None]
        return "str"
    if origin is typing.Literal:
        return list(typing.get_args(tp))
    if origin in (list, tuple) or tp in (list, tuple):
        return "list"
    if origin is dict or tp is dict:
        return "str"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m.value for m in tp]
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    return "str"


def generate() -> dict[str, dict[str, object]]:
    import dataclasses
    import importlib
    import importlib.metadata
    import typing

    out: dict[str, dict[str, object]] = {
        "versions": {p: importlib.metadata.version(p) for p in ("trl", "transformers", "accelerate")}
    }
    for trainer in TRAINERS:
        parser = importlib.import_module(f"trl.scripts.{trainer}").make_parser()
        names: dict[str, object] = {}
        for dtype in parser.dataclass_types:
            hints = typing.get_type_hints(dtype)
            for f in dataclasses.fields(dtype):
                if f.init:
                    kind = _kind(hints.get(f.name, str))
                    choices = (f.metadata or {}).get("choices")
                    names[f.name] = list(choices) if choices and kind == "str" else kind
        out[trainer] = dict(sorted(names.items()))
    return out


def render(schema: dict) -> str:
    lines = ["{"]
    for i, (trainer, names) in enumerate(schema.items()):
        lines.append(f"  {json.dumps(trainer)}: {{")
        items = list(names.items())
        for j, (name, kind) in enumerate(items):
            lines.append(f"    {json.dumps(name)}: {json.dumps(kind)}" + ("," if j < len(items) - 1 else ""))
        lines.append("  }" + ("," if i < len(schema) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


if __name__ == "__main__":
    SCHEMA.write_text(render(generate()))
    print(f"wrote {SCHEMA}")
