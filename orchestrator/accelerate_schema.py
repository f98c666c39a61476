"""What `accelerate launch` reads from an Accelerate config file, as data both sides can check without accelerate.

accelerate copies every key of a config's `deepspeed_config:` / `fsdp_config:` / `parallelism_config:` blocks onto
its launch arguments, but only the arguments its env builders read ever reach the training processes; any other
key is dropped without a word (TRL's own ALST example sets `deepspeed_config.seq_parallel_communication_data_type`,
which never reaches DeepSpeed). `accelerate_args.json` beside this file lists, generated from the installed
accelerate (`python -m orchestrator.accelerate_schema`): the config file's top-level fields (ClusterConfig), the
launch parser's options, and the attributes `accelerate.utils.launch` reads. A test regenerates it and fails when
the installed accelerate disagrees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.errors import OrchError, closest

SCHEMA = Path(__file__).parent / "accelerate_args.json"
BLOCKS = {"deepspeed_config": "", "fsdp_config": "fsdp_", "parallelism_config": "parallelism_config_"}
"""Config blocks whose keys become launch arguments, and the prefix accelerate adds to a key that lacks it."""


@cache
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def check_config(config: Mapping, path: str) -> None:
    """Every key of an Accelerate config reaches `accelerate launch`; a dropped key is an error naming it."""
    known = schema()
    version = known["versions"]["accelerate"]
    for key in config:
        if key not in known["config_fields"]:
            close = closest(str(key), known["config_fields"], cutoff=0.6)
            hint = f"did you mean {close}? " if close else ""
            raise OrchError(
                f"Accelerate config {path}: {key!r} is not an accelerate {version} config field; {hint}"
                "accelerate refuses the file"
            )
    arguments = set(known["launch_arguments"])
    for block, prefix in BLOCKS.items():
        for key in config.get(block) or {}:
            name = key if key.startswith(prefix) else prefix + key
            if name not in arguments:
                close = closest(name, arguments, cutoff=0.75)
                hint = f"did you mean {close}? " if close else ""
                raise OrchError(
                    f"Accelerate config {path}: accelerate {version} does not pass {block}.{key} to the training "
                    f"processes (it is not an `accelerate launch` setting) and would drop it silently; {hint}"
                    + (
                        "remove it, or put DeepSpeed settings in a DeepSpeed JSON named by "
                        "deepspeed_config.deepspeed_config_file"
                        if block == "deepspeed_config"
                        else "remove it"
                    )
                )


# ---------------------------------------------------------------- generation (imports accelerate)


def generate() -> dict:
    import dataclasses
    import importlib.metadata
    import inspect
    import re

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import launch as launch_utils

    dests = {action.dest for action in launch_command_parser()._actions if action.dest != "help"}
    # Attributes the env builders read that are no parser option (e.g. fsdp_ignored_modules from a config file).
    source = inspect.getsource(launch_utils)
    read = set(re.findall(r"\bargs\.([a-z_][a-z0-9_]*)", source))
    read |= set(re.findall(r"getattr\(args, \"([a-z_][a-z0-9_]*)\"", source))
    return {
        "versions": {"accelerate": importlib.metadata.version("accelerate")},
        "config_fields": sorted(f.name for f in dataclasses.fields(ClusterConfig)),
        "launch_arguments": sorted(dests | read),
    }


def render(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


if __name__ == "__main__":
    SCHEMA.write_text(render(generate()))
    print(f"wrote {SCHEMA}")
