"""Secrets of a run: names in files and records, values only in SkyPilot's secrets or the nodes' environment.

`--secret NAME` reads the value from the caller's environment; `--secret NAME=VALUE` works too but leaves the value
in shell history and in orch's own argv. Recorded commands keep secret names and drop their values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from orchestrator.core import credentials
from orchestrator.core.errors import OrchError
from orchestrator.launch.recipe import Recipe


def parse_secrets(words: list[str]) -> dict[str, str]:
    import os

    out = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise OrchError(f"--secret: {name!r} is not an environment variable name (for example HF_TOKEN)")
        if not sep:
            if not os.environ.get(name):
                raise OrchError(
                    f"--secret {name}: {name} is not set in your environment; export it or use {name}=VALUE"
                )
            value = os.environ[name]
        out[name] = value
    return out


def redacted_command(argv: list[str], values: Iterable[str] = ()) -> str:
    """The command as typed, with secret values removed (names kept). Two layers: the value after `--secret NAME=`
    is dropped, and any secret value found anywhere else in the command is masked, so no spelling of a flag (the
    parsers take no abbreviations either) carries one to disk."""
    import shlex

    out, after_secret = [], False
    for word in argv:
        if after_secret:
            word = word.partition("=")[0]
        elif word.startswith("--secret="):
            word = "--secret=" + word[len("--secret=") :].partition("=")[0]
        after_secret = word == "--secret"
        for value in sorted((v for v in values if v), key=len, reverse=True):
            word = word.replace(value, "***")
        out.append(word)
    return "orch " + " ".join(shlex.quote(w) for w in out)


def values_for(recipe: Recipe, given: dict[str, str], smoke: bool) -> dict[str, str]:
    """Secret values: the recipe's non-null ones, then --secret. A null one must be given, except in smoke
    mode, which never reaches a hub."""
    declared = recipe.task.get("secrets") or {}
    if isinstance(declared, list):  # SkyPilot's other spelling: names only, every value given at launch
        declared = dict.fromkeys(declared)
    values = {k: str(v) for k, v in declared.items() if v is not None}
    values.update(given)
    missing = [k for k in declared if k not in values and not smoke]
    if missing:
        raise OrchError(f"recipe needs secret {missing[0]}: pass --secret {missing[0]} (read from your environment)")
    return values


def for_relaunch(task: dict, given: dict[str, str]) -> dict[str, str]:
    """Secret values for a recorded task sent again (`orch run --resume`): its records keep names only, so each
    comes from --secret or, failing that, the caller's environment. A name the task does not have is refused (a
    relaunch sends the task as recorded); a missing one too, except in smoke mode, which never reaches a hub."""
    import os

    from orchestrator.core.knobs import knob

    names = list(task.get("secrets") or {})
    extra = sorted(set(given) - set(names))
    if extra:
        raise OrchError(f"--secret {extra[0]}: the recorded run has no such secret (it has "
                        f"{', '.join(names) or 'none'}); a relaunch sends the task as recorded")  # fmt: skip
    values = dict(given)
    for name in names:
        if name not in values and os.environ.get(name):
            values[name] = os.environ[name]
    smoke = knob(task.get("envs") or {}, "ORCH_SMOKE", "off") == "on"
    missing = [n for n in names if n not in values]
    if missing and not smoke:
        raise OrchError(f"the run needs secret {missing[0]}: pass --secret {missing[0]} (read from your environment)")
    return values


def check_unwritten(written: Mapping[str, str], values: Mapping[str, str]) -> None:
    """Refuse a value bound for the task and sky_jobs/ (`--env`, an override, a recipe env; keyed by how the user
    wrote it) that holds a secret's value: the secret would be written in clear wherever the task goes."""
    for what, value in written.items():
        if name := credentials.holding(str(value), values):
            raise OrchError(f"{what} holds the value of secret {name}, and it would be written to sky_jobs/ and the "
                            f"task; the nodes get {name} in their environment: refer to it there instead")  # fmt: skip
