"""A new node's bytecode, emulated here (tests/test_warm.py, bench/warm.py): uv installs without compiling, while an
image's pip-installed torch comes compiled. A PYTHONPYCACHEPREFIX holding torch's bytecode and nothing else makes
every process that gets it see this environment as such a node (Python then reads and writes bytecode only there)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path


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
