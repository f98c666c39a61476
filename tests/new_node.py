"""A new node's bytecode, emulated here (tests/test_warm.py, bench/warm.py): uv installs without compiling, while an
image's pip-installed torch comes compiled. A PYTHONPYCACHEPREFIX holding torch's bytecode and nothing else makes
every process that gets it see this environment as such a node (Python then reads and writes bytecode only there)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def new_node_prefix(prefix: Path) -> Path:
    """Fill `prefix` with torch's compiled files (this environment's, which `make install` compiled) at the places
    Python looks for them under a PYTHONPYCACHEPREFIX; return it."""
    torch_dir = Path(next(iter(importlib.util.find_spec("torch").submodule_search_locations))).resolve()
    for cache in torch_dir.rglob("__pycache__"):
        target = prefix / cache.parent.relative_to("/")
        target.mkdir(parents=True, exist_ok=True)
        for pyc in cache.glob("*.pyc"):
            shutil.copy2(pyc, target / pyc.name)
    return prefix


def worker_env(prefix: Path, **extra: str) -> dict[str, str]:
    """This process's environment as node 1 of 2 sees it in phi3_dpo_fsdp's setup (SkyPilot's setup variables, the
    recipe's envs), with `prefix` as its PYTHONPYCACHEPREFIX and, as on a node, PYTHONDONTWRITEBYTECODE unset."""
    envs = yaml.safe_load((ROOT / "recipes" / "phi3_dpo_fsdp.yaml").read_text())["envs"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYPILOT_", "PYTHONDONTWRITEBYTECODE"))}
    env.update({k: str(v) for k, v in envs.items()})
    env.update(SKYPILOT_SETUP_NODE_RANK="1", SKYPILOT_SETUP_NODE_IPS="10.0.0.1\n10.0.0.2\n",
               SKYPILOT_SETUP_NUM_GPUS_PER_NODE="2", PYTHONPYCACHEPREFIX=str(prefix), **extra)  # fmt: skip
    return env
