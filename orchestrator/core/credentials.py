"""What a credential looks like, and its mask: one place for the launch side (what may be written to sky_jobs/, the
task and the logs) and the nodes (what their output relay prints).

Secret values travel as SkyPilot secrets (or the local nodes' environment) and nowhere else. Two rules keep them
out of files: a value that holds a declared secret's value, or that looks like a credential whatever its name, is
refused where it would enter the task (`--env`, overrides, a recipe's envs); and every line orch writes from a run's
output (the local run.log, a node's relay, the record) masks the secret values it knows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

NAME = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|API_?KEY|ACCESS_KEY|PRIVATE_KEY|_KEY|_PAT|(^|_)AUTH|CREDENTIALS?|"
    r"COOKIE)$",
    re.I,
)
"""Env names that hold credentials: they go as --secret (never written), not --env (written to sky_jobs/)."""

VALUE = re.compile(
    r"\bhf_[A-Za-z0-9]{12,}|"  # Hugging Face (34 characters; `hf_transfer` is a package)
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}|"  # OpenAI, Anthropic
    r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})|"  # GitHub
    r"\bglpat-[A-Za-z0-9_-]{16,}|"  # GitLab
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|"  # AWS access key ids
    r"\bAIza[0-9A-Za-z_-]{30,}|"  # Google API keys
    r"\bxox[abprs]-[A-Za-z0-9-]{10,}|"  # Slack
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----"
)
"""Values shaped like a credential of a known provider, whatever the variable's name."""

MIN_MASKED = 4
"""Shorter secret values are not masked in output (masking `1` would garble every line); they are still never written
by orch itself."""


def looks_secret(name: str, value: str) -> str:
    """Why an (env name, value) pair looks like a credential ('' when it does not)."""
    if NAME.search(name) and value:
        return f"{name} looks like a credential (by its name)"
    if match := VALUE.search(value):
        return f"its value looks like a credential ({match.group(0)[:5]}...)"
    return ""


MIN_HELD = 8
"""A secret value shorter than this is not looked for inside other values (`x` is in every word): it is still never
written by orch itself, and masked in output from MIN_MASKED characters."""


def holding(value: str, secrets: Mapping[str, str]) -> str:
    """The name of a secret whose value `value` contains ('' when none)."""
    return next((name for name, secret in secrets.items() if len(secret) >= MIN_HELD and secret in value), "")


def from_env(env: Mapping[str, str]) -> list[str]:
    """The values of a node's environment that are secrets by their name (SkyPilot passes secrets as plain env)."""
    return [value for name, value in env.items() if NAME.search(name) and len(value) >= MIN_MASKED]


class Mask:
    """Replaces every known secret value (longest first) and every credential-shaped word with `***`."""

    def __init__(self, values: Iterable[str] = ()):
        self.values = sorted({v for v in values if v and len(v) >= MIN_MASKED}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, "***")
        return VALUE.sub("***", text) if VALUE.search(text) else text
