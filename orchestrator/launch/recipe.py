"""Recipes: SkyPilot task YAMLs whose `envs` name a TRL trainer, a TRL config and an Accelerate config.

`load()` finds and parses a recipe once (its envs as strings, its accelerators as Gpus); `launch.resolved`
applies what the user typed. Plain data in and out; SkyPilot itself is never imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.core import accelerators, configs, files, sky_schema, slots
from orchestrator.core.accelerators import Gpus
from orchestrator.core.errors import OrchError, did_you_mean

REPO_RECIPES = Path(__file__).resolve().parent.parent.parent / "recipes"
REQUIRED_ENVS = ("TRL_TRAINER", "TRL_CONFIG", "ACCELERATE_CONFIG")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    task: dict
    """The parsed task YAML (a SkyPilot task mapping), as written."""
    envs: dict[str, str]
    """The task's envs, every value a string (YAML may give numbers)."""

    @property
    def trainer(self) -> str:
        return self.envs["TRL_TRAINER"]

    @property
    def gpus(self) -> Gpus | None:
        """resources.accelerators per node, or None when the recipe names none."""
        return accelerators.from_resources((self.task.get("resources") or {}).get("accelerators"))

    @property
    def num_nodes(self) -> int:
        return int(self.task.get("num_nodes") or 1)

    @property
    def workdir(self) -> Path:
        return Path(str(self.task.get("workdir") or "."))

    def paired(self, key: str) -> Path:
        """A paired file named in envs, relative to the task's workdir."""
        return self.workdir / self.envs[key]


def is_own(path: Path) -> bool:
    """Whether a recipe file is one of orch's own (their paired files are relative to orch's root)."""
    return path.resolve().parent == REPO_RECIPES.resolve()


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
    try:
        return _find(name_or_path)
    except OSError as exc:  # a name longer than the file system allows, a path through a file
        raise OrchError(f"recipe {name_or_path[:80]!r}: {exc.strerror}; `orch ls` lists the recipes") from None


def _find(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if candidate.exists():  # the loader says what it is when it is no regular file
            return candidate
        raise OrchError(f"recipe file {name_or_path} does not exist; `orch ls` lists the recipes")
    for directory in search_dirs():
        path = directory / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    names = [p.stem for p in all_recipe_paths()]
    hint = did_you_mean(name_or_path, names)
    raise OrchError(f"unknown recipe {name_or_path!r}; {hint}`orch ls` lists the recipes")


def load(name_or_path: str) -> Recipe:
    path = find(name_or_path)
    task = files.load_yaml(path, "recipe")
    if not isinstance(task, dict):
        raise OrchError(f"recipe {path} must be a YAML mapping (a SkyPilot task)")
    envs = task.get("envs")
    if not isinstance(envs, dict):
        raise OrchError(f"recipe {path} has no `envs:` mapping; it must set {', '.join(REQUIRED_ENVS)}")
    sky_schema.check_task(task, f"recipe {path}")  # SkyPilot's own types, before orch reads a field
    if isinstance(task.get("resources"), dict):  # SkyPilot's aliases renamed as its Resources does (gpus: accelerators)
        task = {**task, "resources": sky_schema.resources(task["resources"], f"recipe {path}")}
    workdir = task.get("workdir")
    if isinstance(workdir, dict):  # SkyPilot's git workdir ({url, ref}), cloned on the nodes
        raise OrchError(
            f"recipe {path}: workdir is a git repository ({str(workdir.get('url'))[:100]}): orch reads the recipe's "
            "configs and checks the launch from a local workdir; clone it and run orch there (plain `sky launch` "
            "takes the git workdir as it is)"
        )
    if isinstance(workdir, str):  # SkyPilot rsyncs it through a shell here; orch resolves paths under it
        slots.check("field", workdir.removeprefix("~"), f"recipe {path}: workdir")
    num_nodes = task.get("num_nodes")
    if num_nodes is not None and num_nodes < 1:
        raise OrchError(f"recipe {path}: num_nodes: {num_nodes}: a run needs at least 1 node")
    for key, value in envs.items():
        if isinstance(value, (dict, list)):
            raise OrchError(f"recipe {path}: envs.{key} is a {type(value).__name__}; env values are strings")
    recipe = Recipe(path.stem, path, task, {k: "" if v is None else str(v) for k, v in envs.items()})
    missing = [k for k in REQUIRED_ENVS if not recipe.envs.get(k)]
    if missing:
        raise OrchError(f"recipe {path} does not set {', '.join(missing)} in `envs:`")
    if not str(task.get("run") or "").strip():
        raise OrchError(f"recipe {path} has no `run:` command; it should call `orch node`")
    return recipe


def check_paired_files(recipe: Recipe) -> None:
    """The TRL and Accelerate configs exist (paths are relative to the workdir, the repo root)."""
    for key in ("TRL_CONFIG", "ACCELERATE_CONFIG"):
        value = recipe.envs[key]
        if key == "ACCELERATE_CONFIG" and value in configs.PROFILES:
            continue
        if not recipe.paired(key).is_file():
            own = is_own(recipe.path) and recipe.workdir == Path(".")
            where = f"from {REPO_RECIPES.resolve().parent}" if own else "from the repository root"
            raise OrchError(
                f"{key}={value} (from {recipe.path}) does not exist under workdir {recipe.workdir.resolve()}; "
                f"run orch {where} or fix the path"
            )


DEFAULT_RECIPE = "phi3_dpo_fsdp"


def default_name(environ=None, project: Path = Path(".")) -> tuple[str, str]:
    """(recipe name, why) when the user names none: ORCH_RECIPE, else `[tool.orch] recipe = "..."` in the
    project's pyproject.toml, else orch's own default."""
    import os
    import re

    environ = os.environ if environ is None else environ
    if environ.get("ORCH_RECIPE", "").strip():
        return environ["ORCH_RECIPE"].strip(), "from ORCH_RECIPE"
    pyproject = project / "pyproject.toml"
    if pyproject.is_file():
        text = pyproject.read_text(errors="replace")
        section = re.search(r"^\[tool\.orch\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        match = section and re.search(r"^\s*recipe\s*=\s*[\"']([^\"']+)[\"']", section.group(1), re.M)
        if match:
            return match.group(1), f"the project's default: [tool.orch] recipe in {pyproject}"
    return DEFAULT_RECIPE, "orch's default recipe"
