"""The two config files a recipe pairs with its task, loaded the same way on both sides.

ACCELERATE_CONFIG names a file or one of TRL's profile names (zero1..3, fsdp1, fsdp2, multi_gpu, single_gpu),
resolved in the installed trl package as `trl ... --accelerate_config` does. Where trl is not installed (a
laptop with the launch side only) a profile is read from the snapshot in trl_args.json, generated from that
same folder: never a guess.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib.util
import itertools
import json
import os
import stat
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import files, trl_schema
from orchestrator.core.accelerate_config import AccelerateConfig, with_deepspeed_json
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
    """(the parsed Accelerate config, the file accelerate will read) for a path or a TRL profile name; a DeepSpeed
    config's deepspeed_config_file is read into it (deepspeed_settings)."""
    if value in PROFILES:
        path = profile_path(value)
        raw = load_yaml(path, "Accelerate config") if path.is_file() else trl_schema.profiles()[value]
        return parse_accelerate(raw, f"Accelerate config {value}"), path
    config = parse_accelerate(load_yaml(workdir / value, "Accelerate config"), f"Accelerate config {value}")
    return deepspeed_settings(config, value, workdir), Path(value)


def deepspeed_json_path(name: str, workdir: Path) -> Path:
    """Where accelerate finds a deepspeed_config_file: on the nodes it runs in the workdir, so relative to it."""
    return Path(name) if Path(name).is_absolute() else workdir / name


def deepspeed_settings(config: AccelerateConfig, value: str, workdir: Path) -> AccelerateConfig:
    """The config with its DeepSpeed JSON's ZeRO settings, read as accelerate's HfDeepSpeedConfig reads the value: a
    file (relative to the workdir, where `accelerate launch` runs on the nodes), else the JSON itself, else base64 of
    it. Without this the launch side planned "ZeRO-?": every rank loading the whole model, no offload, no final
    model on disk. One line where accelerate would stop on the nodes."""
    name = config.deepspeed_config_file
    if not (config.deepspeed and name):
        return config
    where = f"Accelerate config {value}: deepspeed_config_file {name}"
    path = deepspeed_json_path(name, workdir)
    if os.path.exists(path):  # as accelerate tells a file from the JSON itself (a long JSON is no file name)
        data = files.load_json(path, "DeepSpeed JSON", files.CONFIG_MAX)
    else:
        try:
            try:
                data = json.loads(name)
            except ValueError:
                data = json.loads(base64.urlsafe_b64decode(name).decode("utf-8"))
        except (ValueError, binascii.Error, RecursionError):
            raise OrchError(f"{where} is not a file in the workdir: accelerate reads it on the nodes from the "
                            "directory it runs in, the workdir orch run uploads (the repository root); give its path "
                            "from there or the JSON itself") from None  # fmt: skip
    return with_deepspeed_json(config, data, where)


def load(env: Mapping[str, str], workdir: Path = Path(".")) -> Configs:
    """The Accelerate and TRL configs named by a recipe's env (paths relative to workdir, the repo root)."""
    accel_value = required(env, "ACCELERATE_CONFIG", "recipes/accelerate/fsdp2_phi3.yaml")
    trl_path = workdir / required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml")
    trl = load_yaml(trl_path, "TRL config")
    accel, accel_file = load_accelerate(accel_value, workdir)
    return Configs(accel, trl, accel_file)


BIG_FILE = 1 << 20
"""files_named reads a file up to this size; a bigger one is keyed by its name, size and modification time."""
MAX_ENTRIES = 1000
"""Of a folder (a tokenizer's), the entries files_named keys, in name order."""


def files_named(argv: list[str], workdir: Path) -> list[bytes]:
    """The contents of the files an argv names, directly or through its configs (their edits change the result):
    the Accelerate config and its DeepSpeed JSON, the TRL config, its chat template (a file, or a tokenizer's
    folder) and the workdir's modules its dotted reward functions import. A value given twice (the TRL config's and an
    override) keys both (a rehearsal's cache key: rehearsal/driver.py)."""

    def bytes_of(path: Path) -> bytes:  # a regular file's; a big one (a model's weights beside its tokenizer): its
        try:  # size and time; never a FIFO's or a device's
            found = path.stat()
            if not stat.S_ISREG(found.st_mode):
                return b"not a regular file"
            return path.read_bytes() if found.st_size <= BIG_FILE else f"{found.st_size}:{found.st_mtime_ns}".encode()
        except OSError:  # absent, unreadable, a name too long to be a file
            return b""

    def read(name: object) -> list[bytes]:
        path = Path(str(name))
        path = path if path.is_absolute() else workdir / path
        try:
            entries = sorted(path.iterdir())[:MAX_ENTRIES] if path.is_dir() else None
        except OSError:
            entries = None
        if entries is not None:
            return [p.name.encode() + bytes_of(p) for p in entries]
        return [bytes_of(path)]

    def loaded(content: bytes) -> dict:
        with contextlib.suppress(OrchError, UnicodeDecodeError):
            data = files.parse_yaml(content.decode("utf-8"), "a config")
            return data if isinstance(data, dict) else {}
        return {}

    def given(flag: str, config: dict) -> list[object]:
        values = [config[flag]] if config.get(flag) not in (None, "") else []
        for i, word in enumerate(argv):
            if word == f"--{flag}":  # a list argument's words run to the next flag
                values += list(itertools.takewhile(lambda w: not w.startswith("--"), argv[i + 1:]))
        return values

    found = []
    for flag in ("--config_file", "--config"):
        if flag not in argv:
            continue
        content = (read(argv[argv.index(flag) + 1]) or [b""])[0]  # (a folder's first file, none of an empty one)
        found.append(content)
        config = loaded(content)
        if flag == "--config_file":
            ds = config.get("deepspeed_config")
            if isinstance(ds, dict) and ds.get("deepspeed_config_file"):
                found += read(ds["deepspeed_config_file"])
            continue
        for template in given("chat_template_path", config):
            found += read(template)
        for funcs in given("reward_funcs", config):
            for func in funcs if isinstance(funcs, list) else str(funcs).split():
                module = str(func).rpartition(".")[0].replace(".", "/")
                if module:
                    found += read(f"{module}.py") + read(f"{module}/__init__.py")
    return found
