"""The two config files a recipe pairs with its task, loaded the same way on both sides.

ACCELERATE_CONFIG names a file or one of TRL's profile names (zero1..3, fsdp1, fsdp2, multi_gpu, single_gpu),
resolved in the installed trl package as `trl ... --accelerate_config` does. Where trl is not installed (a
laptop with the launch side only) a profile is read from the snapshot in trl_args.json, generated from that
same folder: never a guess.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import files, trl_schema
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.accelerate_config import parse as parse_accelerate
from orchestrator.core.errors import OrchError

PROFILES = ("zero1", "zero2", "zero3", "fsdp1", "fsdp2", "multi_gpu", "single_gpu")
"""TRL's Accelerate profile names (trl/accelerate_configs/<name>.yaml)."""
CPU_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cpu.yaml"


class Configs(NamedTuple):
    """A recipe's paired configs, parsed."""

    accelerate: AccelerateConfig
    """The Accelerate config, parsed (its mapping as written: `.raw`)."""
    trl: dict
    """The TRL config file's arguments (key=value overrides are applied by the caller)."""
    accelerate_file: Path
    """The file `accelerate launch --config_file` gets: the path given, or where a TRL profile lives."""


def required(env: Mapping[str, str], name: str, example: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise OrchError(f"{name} is not set; the recipe's `envs:` must give it (for example {name}: {example})")
    return value


@cache
def trl_profile_dir() -> Path | None:
    """trl/accelerate_configs of the installed trl, or None where trl is not installed."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "accelerate_configs"


def profile_path(name: str) -> Path:
    """Where a TRL profile lives: the installed trl's file, else the same relative path (the node has trl)."""
    folder = trl_profile_dir()
    return (folder or Path("trl") / "accelerate_configs") / f"{name}.yaml"


def resolve_accelerate_config(value: str) -> Path:
    """The file `accelerate launch --config_file` gets for an ACCELERATE_CONFIG value (a path or a profile)."""
    return profile_path(value) if value in PROFILES else Path(value)


def load_yaml(path: Path, what: str) -> dict:
    data = files.load_yaml(path, what)
    if not isinstance(data, dict):
        raise OrchError(f"{what} {path} must be a YAML mapping of settings")
    return data


def load_accelerate(value: str, workdir: Path = Path(".")) -> tuple[AccelerateConfig, Path]:
    """(the parsed Accelerate config, the file accelerate will read) for a path or a TRL profile name."""
    if value in PROFILES:
        path = profile_path(value)
        raw = load_yaml(path, "Accelerate config") if path.is_file() else trl_schema.profiles()[value]
        return parse_accelerate(raw, f"Accelerate config {value}"), path
    return parse_accelerate(load_yaml(workdir / value, "Accelerate config"), f"Accelerate config {value}"), Path(value)


def load(env: Mapping[str, str], workdir: Path = Path(".")) -> Configs:
    """The Accelerate and TRL configs named by a recipe's env (paths relative to workdir, the repo root)."""
    accel_value = required(env, "ACCELERATE_CONFIG", "recipes/accelerate/fsdp2_phi3.yaml")
    trl_path = workdir / required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml")
    trl = load_yaml(trl_path, "TRL config")
    accel, accel_file = load_accelerate(accel_value, workdir)
    return Configs(accel, trl, accel_file)
