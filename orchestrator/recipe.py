"""Recipes: SkyPilot task YAMLs whose `envs` name a TRL trainer, a TRL config and an Accelerate config.

`load()` finds and parses a recipe; `resolve()` applies what the user typed (nodes, GPUs, envs, TRL
overrides) and returns a new task mapping, ready to be written to sky_jobs/ or run locally. Plain data in
and out; SkyPilot itself is never imported here.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator import overrides as ov
from orchestrator import yamlio
from orchestrator.errors import OrchError, closest

REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
REQUIRED_ENVS = ("TRL_TRAINER", "TRL_CONFIG", "ACCELERATE_CONFIG")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Recipe:
    name: str
    path: Path
    task: dict
    """The parsed task YAML (a SkyPilot task mapping)."""

    @property
    def envs(self) -> dict[str, str]:
        return {k: "" if v is None else str(v) for k, v in (self.task.get("envs") or {}).items()}

    @property
    def trainer(self) -> str:
        return self.envs["TRL_TRAINER"]

    @property
    def accelerators(self) -> str | None:
        acc = (self.task.get("resources") or {}).get("accelerators")
        if isinstance(acc, dict):  # {"A100": 8}
            ((name, count),) = acc.items()
            return f"{name}:{count}"
        return None if acc is None else str(acc)

    @property
    def num_nodes(self) -> int:
        return int(self.task.get("num_nodes") or 1)

    @property
    def workdir(self) -> Path:
        return Path(str(self.task.get("workdir") or "."))

    def paired(self, key: str) -> Path:
        """A paired file named in envs, relative to the task's workdir."""
        return self.workdir / self.envs[key]


def search_dirs() -> list[Path]:
    here = Path("recipes")
    dirs = [here] if here.is_dir() else []
    if REPO_RECIPES.is_dir() and REPO_RECIPES.resolve() not in [d.resolve() for d in dirs]:
        dirs.append(REPO_RECIPES)
    return dirs


def all_recipe_paths() -> list[Path]:
    """Every recipe task YAML: top-level *.yaml of each recipes dir (configs live in subfolders)."""
    seen: dict[str, Path] = {}
    for directory in search_dirs():
        for path in sorted(directory.glob("*.yaml")):
            seen.setdefault(path.stem, path)
    return sorted(seen.values(), key=lambda p: p.stem)


def find(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if candidate.is_file():
            return candidate
        raise OrchError(f"recipe file {name_or_path} does not exist; `orch ls` lists the recipes")
    for directory in search_dirs():
        path = directory / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    names = [p.stem for p in all_recipe_paths()]
    close = closest(name_or_path, names)
    hint = f"did you mean {close}? " if close else ""
    raise OrchError(f"unknown recipe {name_or_path!r}; {hint}`orch ls` lists the recipes")


def load(name_or_path: str) -> Recipe:
    path = find(name_or_path)
    try:
        task = yamlio.load(path.read_text())
    except yamlio.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise OrchError(f"recipe {path} is not valid YAML{where}; fix the file") from None
    if not isinstance(task, dict):
        raise OrchError(f"recipe {path} must be a YAML mapping (a SkyPilot task)")
    recipe = Recipe(name=path.stem, path=path, task=task)
    envs = task.get("envs")
    if not isinstance(envs, dict):
        raise OrchError(f"recipe {path} has no `envs:` mapping; it must set {', '.join(REQUIRED_ENVS)}")
    missing = [k for k in REQUIRED_ENVS if not recipe.envs.get(k)]
    if missing:
        raise OrchError(f"recipe {path} does not set {', '.join(missing)} in `envs:`")
    if not str(task.get("run") or "").strip():
        raise OrchError(f"recipe {path} has no `run:` command; it should call `orch node`")
    return recipe


def check_paired_files(recipe: Recipe) -> None:
    """The TRL and Accelerate configs exist (paths are relative to the workdir, the repo root)."""
    from orchestrator.node import PROFILES

    for key in ("TRL_CONFIG", "ACCELERATE_CONFIG"):
        value = recipe.envs[key]
        if key == "ACCELERATE_CONFIG" and value in PROFILES:
            continue
        if not recipe.paired(key).is_file():
            raise OrchError(
                f"{key}={value} (from {recipe.path}) does not exist under workdir {recipe.workdir.resolve()}; "
                "run orch from the repository root or fix the path"
            )


def parse_env_assignments(words: list[str]) -> dict[str, str]:
    """`--env K=V` values (`--env K` takes K from the caller's environment, as `sky launch --env` does)."""
    import os

    out: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not _ENV_NAME.match(key):
            raise OrchError(f"--env {word!r}: {key!r} is not an environment variable name (letters, digits, _)")
        if not sep:
            if key not in os.environ:
                raise OrchError(f"--env {key}: {key} is not set here; give a value with --env {key}=VALUE")
            value = os.environ[key]
        ov.check_value(f"--env {key}=", value)
        out[key] = value
    return out


def resolve(
    recipe: Recipe,
    *,
    nodes: int | None = None,
    accelerators: str | None = None,
    envs: dict[str, str] | None = None,
    trl_overrides: dict[str, str] | None = None,
) -> dict:
    """A new task mapping with what the user typed applied over the recipe (the user's flags win)."""
    task = copy.deepcopy(recipe.task)
    if nodes is not None:
        task["num_nodes"] = nodes
    if accelerators is not None:
        task.setdefault("resources", {})
        task["resources"] = dict(task["resources"] or {}, accelerators=accelerators)
    task_envs = {k: "" if v is None else str(v) for k, v in (task.get("envs") or {}).items()}
    task_envs.update(envs or {})
    if trl_overrides:
        merged = ov.loads(task_envs.get("TRL_OVERRIDES", ""))
        merged.update(trl_overrides)
        task_envs["TRL_OVERRIDES"] = ov.dumps(merged)
    task["envs"] = task_envs
    return task
