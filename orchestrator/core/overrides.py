"""`key=value` overrides of TRL arguments: parsed on the launch side, carried to the nodes in TRL_OVERRIDES.

TRL_OVERRIDES is a plain task env (visible in the resolved task YAML, so `sky launch sky_jobs/X.yaml`
replays it) holding space-separated `key=value` words, each shell-quoted. The node launcher turns them into
`--key value` arguments of the TRL script, after `--config`, so they win over the TRL config file.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

from orchestrator.core import credentials
from orchestrator.core.errors import OrchError

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


SHELL_METACHARACTERS = set("$`;|&<>")


def check_value(what: str, value: str) -> None:
    """Values reach the nodes' shell through SkyPilot's envs: refuse what a shell would act on."""
    if any(ch in value for ch in "\n\r\0"):
        raise OrchError(f"{what} holds a newline or NUL byte; give a single-line value")
    bad = sorted(SHELL_METACHARACTERS & set(value))
    if bad:
        raise OrchError(
            f"{what} holds shell metacharacter(s) {' '.join(bad)}; values travel through the nodes' shell, so use "
            "plain text (secrets go in --secret)"
        )


def parse(words: Iterable[str]) -> dict[str, str]:
    """`["lr=1e-5", "max_steps=10"]` -> `{"lr": "1e-5", "max_steps": "10"}`; later words win."""
    out: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not _KEY.match(key):
            raise OrchError(f"override {word!r} is not key=value (for example learning_rate=1e-5)")
        check_value(f"override {key}=", value)
        if why := credentials.looks_secret("", value):
            raise OrchError(f"override {key}=: {why}, and overrides are written to sky_jobs/ and the task; pass "
                            "the credential as a secret (--secret HF_TOKEN, read from your environment, never "
                            "written)")  # fmt: skip
        out[key] = value
    return out


def dumps(overrides: dict[str, str]) -> str:
    """Serialize for the TRL_OVERRIDES env: `k=v k2='v 2'`."""
    return " ".join(shlex.quote(f"{k}={v}") for k, v in overrides.items())


def both_launchers(fix: Mapping[str, str], envs: Mapping[str, str]) -> str:
    """How a node's fix (TRL overrides) is given to each launcher: `(`orch run RECIPE k=v`, or `sky launch ... --env
    TRL_OVERRIDES='...'`)`, the latter keeping the overrides the node already has (`envs`' TRL_OVERRIDES)."""
    words = " ".join(f"{k}={v}" for k, v in fix.items())
    merged = dumps({**loads(envs.get("TRL_OVERRIDES", "")), **fix})
    return f"(`orch run RECIPE {words}`, or `sky launch ... --env TRL_OVERRIDES={shlex.quote(merged)}`)"


def loads(text: str) -> dict[str, str]:
    """Inverse of `dumps`, used on the node."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise OrchError(
            f"TRL_OVERRIDES={text!r} cannot be split into words ({exc}); quote values with spaces"
        ) from None
    return parse(words)


def effective(trl_config: Mapping, overrides: Mapping[str, str]) -> dict:
    """The TRL settings the script will see: the config file's, then key=value overrides over them."""
    return {**trl_config, **overrides}


def eval_strategy(value) -> str | None:
    """The eval_strategy a TRL setting names where the trainer evaluates ('steps', 'epoch'), None where it does not:
    absent, `no`, or YAML's unquoted no (false, which trl_schema's check refuses first, asking for "no" in quotes)."""
    word = "no" if value is None else str(value).strip().lower()
    return None if word in ("no", "false") else word


def truthy(value) -> bool:
    """A TRL boolean as YAML (true) or an override ("true", "1", "yes") gives it."""
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def to_argv(overrides: Mapping[str, str], trainer: str | None = None) -> list[str]:
    """`{"max_steps": "10"}` -> `["--max_steps", "10"]` (TRL's HfArgumentParser syntax).

    List arguments (e.g. `reward_funcs=accuracy_reward think_format_reward`) become one word per item.
    """
    from orchestrator.core import trl_schema

    argv: list[str] = []
    for key, value in overrides.items():
        if trainer and trl_schema.is_list(trainer, key):
            argv += [f"--{key}", *value.split()]
        else:
            argv += [f"--{key}", value]
    return argv
