"""YAML in and out. Loading uses libyaml's C parser when PyYAML has it (several times faster: `orch ls`
parses every recipe and its configs)."""

from __future__ import annotations

import yaml

YAMLError = yaml.YAMLError
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(text: str):
    """yaml.safe_load, with the C parser when available."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader


class _TaskDumper(yaml.SafeDumper):
    """Multi-line strings (setup:, run:) as literal blocks, as people write them."""


def _represent_str(dumper: yaml.SafeDumper, data: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_TaskDumper.add_representer(str, _represent_str)


def dump_task(task: dict) -> str:
    return yaml.dump(task, Dumper=_TaskDumper, sort_keys=False, default_flow_style=False, width=1000)
