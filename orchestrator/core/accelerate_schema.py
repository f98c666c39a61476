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
BLOCKS = ("deepspeed_config", "fsdp_config", "parallelism_config", "dynamo_config", "fp8_config")
"""Config blocks whose keys become launch arguments (`launch_name`)."""
PREFIXED = {"fsdp_config": ("fsdp", "fsdp_"), "fp8_config": ("fp8", "fp8_"), "dynamo_config": ("dynamo_", "dynamo_")}
"""accelerate's launcher (commands/launch.py, `_validate_launch_command`) names a key of these blocks with the prefix
when it does not start with the first word; every other block's keys are taken as written, so a parallelism_config
`cp_size` is set as `args.cp_size`, which nothing reads (orch took it for parallelism_config_cp_size and said nothing
while accelerate dropped it)."""


def launch_name(block: str, key: str) -> str:
    """The launch argument a key of an Accelerate config block becomes (`offload_params` in fsdp_config is
    fsdp_offload_params; tests/test_deepspeed_json.py compares with accelerate's own launcher)."""
    start, prefix = PREFIXED.get(block, ("", ""))
    return key if key.startswith(start) else prefix + key


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
    for key, value in config.items():
        _check_value(key, key, value, path)
    for block in BLOCKS:
        for key, value in (config.get(block) or {}).items():
            name = launch_name(block, str(key))
            _check_value(name, f"{block}.{key}", value, path)
            if name not in arguments:
                full = f"{block}_{key}"  # parallelism_config's keys carry the block's name: parallelism_config_cp_size
                hint = f"did you mean {block}.{full}? " if full in arguments else (
                    did_you_mean(name, arguments, cutoff=0.75))
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


EXACT = ("distributed_type",)
"""Values accelerate takes as written (an enum by value): `fsdp` is "'fsdp' is not a valid DistributedType"."""
ENUMS = ("fsdp_sharding_strategy", "fsdp_auto_wrap_policy", "fsdp_backward_prefetch", "fsdp_state_dict_type")
"""FSDP settings accelerate's plugin looks up in torch's enums: by name, any case, or by number (1 = the first)."""


def _check_value(name: str, where: str, value, path: str) -> None:
    """A value accelerate takes for launch argument `name` (its parser's choices, the FSDP enum names), else one line
    naming them: a config file's values skip the parser's choices, and the plugin failed in the trainer's constructor
    (`KeyError: 'SHARDED'`) or took fsdp_version 3 for FSDP1 (`KeyError: 'TRUE'`)."""
    allowed = schema().get("choices", {}).get(name)
    if allowed is None or value is None or isinstance(value, (dict, list)):
        return
    text = str(value).strip()
    if text in allowed or (name not in EXACT and text.lower() in {c.lower() for c in allowed}):
        return
    if name in ENUMS and text.isdigit() and 1 <= int(text) <= len(allowed):
        return
    hint = did_you_mean(text.upper() if name in ENUMS + EXACT else text, allowed, cutoff=0.6, begins=True)
    raise OrchError(f"Accelerate config {path}: {where}: {value!r} is not one accelerate takes; {hint}use one of "
                    f"{', '.join(allowed)}")  # fmt: skip


def render(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"
