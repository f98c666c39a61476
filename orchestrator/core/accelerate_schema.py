"""What `accelerate launch` reads from an Accelerate config file, as data both sides can check without accelerate.

accelerate copies every key of a config's `deepspeed_config:` / `fsdp_config:` / `parallelism_config:` blocks onto
its launch arguments, but only the arguments its env builders read ever reach the training processes; any other
key is dropped without a word (TRL's own ALST example sets `deepspeed_config.seq_parallel_communication_data_type`,
which never reaches DeepSpeed). `accelerate_args.json` beside this file lists, generated from the installed
accelerate (`python -m orchestrator.train.snapshots`): the config file's top-level fields (ClusterConfig), the
launch parser's options, and the attributes `accelerate.utils.launch` reads. A test regenerates it and fails when
the installed accelerate disagrees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.core.errors import OrchError, did_you_mean

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
            hint = did_you_mean(str(key), known["config_fields"], cutoff=0.6)
            raise OrchError(
                f"Accelerate config {path}: {key!r} is not an accelerate {version} config field; {hint}"
                "accelerate refuses the file"
            )
    arguments = set(known["launch_arguments"])
    for block, prefix in BLOCKS.items():
        for key in config.get(block) or {}:
            name = key if key.startswith(prefix) else prefix + key
            if name not in arguments:
                hint = did_you_mean(name, arguments, cutoff=0.75)
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


def render(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"
