"""The one quoting boundary: every value orch puts where a shell or SkyPilot's `${VAR}` substitution will read
unquoted goes through here, checked against the strict character set of its slot (`check`), with one line naming
the slot's rule. (Values orch writes into a shell line itself are shlex-quoted where they are written: overrides'
TRL_OVERRIDES words, recorded commands.)

Why slots and not quoting everywhere: SkyPilot substitutes a task's envs into its other fields (`file_mounts`,
`workdir`, storage names) textually, before YAML types matter, and some of those fields reach a shell on the laptop
(rsync, `shell=True`) or on the nodes (`docker pull`) unquoted. A value there must be data by its characters alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from orchestrator.core.errors import OrchError

SLOTS: dict[str, tuple[re.Pattern[str], str]] = {
    # S3's and GCS's common rule (the stricter of the two): 3-63 lowercase letters, digits, '-' and '.'
    "bucket": (re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
               "3-63 lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"),
    # an AMI, a GCP image path, `docker:<registry>/<repo>:<tag>@sha256:<digest>`
    "image": (re.compile(r"(docker:)?[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}"),
              "letters, digits and . _ / : @ + - (an AMI id, an image path or docker:<image>)"),
    "cluster": (re.compile(r"[A-Za-z]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?"),  # SkyPilot's own rule
                "letters, digits, '-', '_' or '.', starting with a letter and ending with a letter or digit"),
    # anything substituted into a task field other than run/setup: a path, a URL, a name
    "field": (re.compile(r"[A-Za-z0-9._/:@+=,%-]{0,1024}"),
              "letters, digits and . _ / : @ + = , % - (no spaces, quotes or shell characters)"),
}  # fmt: skip
# the task fields SkyPilot runs or exports itself (quoted by SkyPilot: `export K=<shlex.quote(v)>`)
_SHELL_FIELDS = ("run", "setup", "envs", "secrets", "name", "config")
_REFERENCE = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?")  # sky/task.py's _fill_in_env_vars, verbatim


def check(slot: str, value: str, what: str) -> str:
    pattern, rule = SLOTS[slot]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        shown = repr(value)[:80]
        raise OrchError(f"{what} {shown}: use {rule}")
    return value


def safe_path(path: str) -> bool:
    """Whether a local path can travel unquoted (SkyPilot's rsync of a file mount's source runs in a shell)."""
    return bool(SLOTS["field"][0].fullmatch(path))


def check_substitutions(task: Mapping, envs: Mapping[str, str]) -> None:
    """Every env a task's fields reference as `${VAR}` or `$VAR` outside run/setup (SkyPilot substitutes them as
    text) holds a value fit for its slot: a storage's `name` a bucket name, anything else the `field` set."""
    for where, text in _strings(task):
        slot = "bucket" if where.endswith(".name") and where.startswith("file_mounts.") else "field"
        for match in _REFERENCE.finditer(text):
            name = match.group(1)
            if name in envs:
                check(slot, str(envs[name]), f"{name} (substituted into the task's {where})")


def _strings(node, where: str = ""):
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not where and key in _SHELL_FIELDS:
                continue
            yield from _strings(value, f"{where}.{key}" if where else str(key))
            if isinstance(key, str) and where:
                yield f"{where} (a key)", key
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _strings(item, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node
