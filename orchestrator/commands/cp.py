"""`orch cp NAME DEST`: copy a recipe and its paired configs into an editable template.

The copy is still a plain SkyPilot task: `sky launch recipes/DEST.yaml` and `orch run DEST` both run it.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from orchestrator.commands import add
from orchestrator.core.errors import OrchError

EPILOG = """\
examples:
  orch cp phi3_dpo_fsdp my_dpo          # recipes/my_dpo.yaml + recipes/trl/my_dpo.yaml + recipes/accelerate/my_dpo.yaml
  orch cp phi3_dpo_fsdp recipes/exp/dpo_a.yaml  # configs go to recipes/exp/trl/ and recipes/exp/accelerate/
  orch cp phi3_dpo_fsdp my_dpo --force  # overwrite an earlier copy (never a config another recipe uses)
Copies go only inside ./recipes/ and never overwrite a file another recipe uses.
then edit the copies and run: orch run my_dpo --local --nodes 2 --smoke
"""
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "cp",
        help="copy a recipe and its configs into an editable template",
        description="Copy a recipe and its paired TRL and Accelerate configs.",
        epilog=EPILOG,
    )
    parser.add_argument("recipe", help="recipe to copy (see `orch ls`)")
    parser.add_argument("dest", help="new recipe name (goes to recipes/) or path ending in .yaml")
    parser.add_argument("--force", action="store_true", help="overwrite existing files of that name")
    parser.set_defaults(func=main)


MAX_NAME = 100


def destinations(dest: str) -> tuple[Path, Path, Path]:
    """(task, TRL config, Accelerate config) paths for a DEST name or path, all inside ./recipes/."""
    if dest.endswith((".yaml", ".yml")):
        task = Path(dest)
    elif _NAME.match(dest) and "/" not in dest:
        task = Path("recipes") / f"{dest}.yaml"
    else:
        raise OrchError(
            f"DEST {dest[:80]!r} must be a name like my_dpo (letters, digits, _ . -) or a path ending in .yaml"
        )
    if len(task.stem) > MAX_NAME:
        raise OrchError(f"DEST name is {len(task.stem)} characters, too long: use at most {MAX_NAME}")
    if not _NAME.match(task.stem):
        raise OrchError(f"DEST file name {task.name!r} must start with a letter (letters, digits, _ . -)")
    recipes = Path("recipes").resolve()
    paths = (task, task.parent / "trl" / f"{task.stem}.yaml", task.parent / "accelerate" / f"{task.stem}.yaml")
    for path in paths:  # resolved: a linked folder on the way must not lead out of recipes/
        if not path.resolve().is_relative_to(recipes):
            raise OrchError(f"DEST {dest!r}: copies go inside recipes/ (e.g. my_dpo or recipes/exp/my_dpo.yaml)"
                            + (f"; {path} leads to {path.resolve()}" if path != task else ""))  # fmt: skip
    return paths


def users_of_configs(skip: Path | None = None) -> dict[Path, list[str]]:
    """Every TRL/Accelerate config file a recipe names -> the recipes that name it (the recipe at `skip` left out)."""
    from orchestrator.core import files
    from orchestrator.launch.recipe import all_recipe_paths

    users: dict[Path, list[str]] = {}
    for path in all_recipe_paths():
        if skip is not None and path.resolve() == skip.resolve():
            continue
        try:
            envs = (files.load_yaml(path, "recipe") or {}).get("envs") or {}
        except Exception:  # an unreadable recipe names nothing (orch ls reports it)
            continue
        for key in ("TRL_CONFIG", "ACCELERATE_CONFIG"):
            if isinstance(envs, dict) and envs.get(key):
                users.setdefault(Path(str(envs[key])).resolve(), []).append(path.stem)
        if isinstance(envs, dict) and (json_file := _deepspeed_json(str(envs.get("ACCELERATE_CONFIG") or ""))):
            users.setdefault(json_file.resolve(), []).append(path.stem)
    return users


def _deepspeed_json(accel_value: str) -> Path | None:
    """The DeepSpeed JSON file an Accelerate config file names (deepspeed_config.deepspeed_config_file), None for a
    profile, a config without one or a JSON given inline."""
    from orchestrator.core import files
    from orchestrator.core.configs import PROFILES, deepspeed_json_path

    if not accel_value or accel_value in PROFILES:
        return None
    try:
        config = files.load_yaml(Path(accel_value), "Accelerate config")
    except Exception:  # an unreadable config names nothing here (loading the recipe reports it)
        return None
    ds = config.get("deepspeed_config") if isinstance(config, dict) else None
    name = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    path = deepspeed_json_path(str(name), Path(".")) if name else None
    return path if path is not None and os.path.isfile(path) else None  # (a JSON given inline is no file name)


def _relative(path: Path) -> str:
    """How the recipe's envs name a file: relative to the workdir (the current directory) when inside it."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def _write_all(files: dict[Path, str]) -> None:
    """Write every file or none: temp files first, then renames."""
    staged = []
    made: list[Path] = []
    try:
        for path, text in files.items():
            for parent in reversed([path.parent, *path.parent.parents]):
                if not parent.exists():
                    parent.mkdir()
                    made.append(parent)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            staged.append((tmp, path))
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        for tmp, path in staged:
            os.replace(tmp, path)
    except OSError as exc:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        for folder in reversed(made):
            folder.rmdir()
        raise OrchError(f"cannot write {exc.filename or path}: {exc.strerror}") from None
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)


def main(args: argparse.Namespace) -> int:
    import yaml

    from orchestrator.core.configs import PROFILES, load_accelerate
    from orchestrator.launch.recipe import check_paired_files, load

    source = load(args.recipe)
    check_paired_files(source)
    task_dst, trl_dst, accel_dst = destinations(args.dest)
    new = task_dst.stem
    accel_value = source.envs["ACCELERATE_CONFIG"]
    accel_config, accel_file = load_accelerate(accel_value, source.workdir)
    if accel_value not in PROFILES:
        accel_text = (source.workdir / accel_file).read_text()
    elif accel_file.is_file():
        accel_text = accel_file.read_text()  # the installed trl's profile, copied to edit
    else:  # trl is not installed here: orch's snapshot of TRL's profile
        accel_text = f"# TRL's {accel_value} profile, copied by `orch cp`\n" + yaml.safe_dump(
            accel_config, sort_keys=False
        )
    if task_dst.resolve() == source.path.resolve():
        raise OrchError(f"{args.dest} is the recipe itself; pick another name")
    # a DeepSpeed JSON the Accelerate config names is copied beside it (recipes/accelerate/DEST.json) and the copy's
    # config names the copy: an edit of the copy's ZeRO settings must not change the recipe it came from
    json_src = _deepspeed_json(str(source.workdir / accel_file)) if accel_value not in PROFILES else None
    json_dst = accel_dst.with_suffix(".json") if json_src else None
    if json_src and json_dst:
        accel_text, count = re.subn(r"^(\s*deepspeed_config_file\s*:\s*).*$", rf"\g<1>{_relative(json_dst)}",
                                    accel_text, count=1, flags=re.M)  # fmt: skip
        if not count:
            raise OrchError(f"{accel_file}: its deepspeed_config_file is not on a line of its own, which `orch cp` "
                            "rewrites to name the copy's JSON; write it as `deepspeed_config_file: PATH`")  # fmt: skip
    users = users_of_configs(skip=task_dst)
    for path, what in ((trl_dst, "TRL config"), (accel_dst, "Accelerate config"),
                       *([(json_dst, "DeepSpeed JSON")] if json_dst else [])):  # fmt: skip
        if users.get(path.resolve()):
            raise OrchError(
                f"{path} is the {what} of {', '.join(users[path.resolve()])}: a copy must not overwrite it, even "
                "with --force; pick another name"
            )
    wanted = [task_dst, trl_dst, accel_dst, *([json_dst] if json_dst else [])]
    for path in wanted:  # on a case-insensitive file system (macOS) Phi3_DPO.yaml is phi3_dpo.yaml
        alike = [p for p in (path.parent.iterdir() if path.parent.is_dir() else [])
                 if p.name.lower() == path.name.lower() and p.name != path.name]  # fmt: skip
        if alike:
            raise OrchError(f"{path} differs from {alike[0]} only in case: on a case-insensitive file system it is "
                            "the same file; pick another name")  # fmt: skip
    taken = [p for p in wanted if p.exists()]
    if taken and not args.force:
        raise OrchError(
            f"{taken[0]} already exists; pass --force to overwrite it, or pick another name "
            "(`orch ls` shows the names in use)"
        )

    old, old_sky, new_sky = source.name, source.name.replace("_", "-"), new.replace("_", "-")
    text = source.path.read_text()
    text = text.replace(f"recipes/{old}.yaml", _relative(task_dst))
    text = re.sub(rf"\borch run {re.escape(old)}\b", f"orch run {new}", text)
    text = re.sub(rf"(^# ){re.escape(old)}:", rf"\g<1>{new}:", text, count=1, flags=re.M)
    text = re.sub(rf"\b{re.escape(old_sky)}\b", new_sky, text)
    text = re.sub(r"^(  TRL_CONFIG:).*$", rf"\1 {_relative(trl_dst)}", text, count=1, flags=re.M)
    text = re.sub(r"^(  ACCELERATE_CONFIG:).*$", rf"\1 {_relative(accel_dst)}", text, count=1, flags=re.M)
    text = re.sub(r"output_dir=outputs/[^\s\"']+", f"output_dir=outputs/{new}", text)
    text = f"# Copied from {old} by `orch cp`: edit freely.\n" + text
    trl_text = re.sub(
        r"^output_dir:.*$", f"output_dir: outputs/{new}", source.paired("TRL_CONFIG").read_text(), count=1, flags=re.M
    )
    files = {task_dst: text, trl_dst: trl_text, accel_dst: accel_text}
    if json_src and json_dst:
        files[json_dst] = json_src.read_text()
    _write_all(files)
    copied = load(str(task_dst))  # the copy must load, name its own files, and be what we think
    check_paired_files(copied)
    for path in files:
        print(f"wrote {path}")
    shared = {source.paired("TRL_CONFIG"): "TRL config"}
    if accel_value not in PROFILES:
        shared[source.workdir / accel_file] = "Accelerate config"
    if json_src:
        shared[json_src] = "DeepSpeed JSON"
    for path, what in shared.items():
        others = [r for r in users.get(path.resolve(), []) if r != source.name]
        if others:
            print(f"note: {source.name}'s {what} {path} is shared with {', '.join(others)}; your copy has its own")
    print(
        f"next: edit them, then `orch run {new if task_dst.parent == Path('recipes') else task_dst} "
        "--local --nodes 2 --smoke` or `sky launch " + _relative(task_dst) + "`"
    )
    return 0
