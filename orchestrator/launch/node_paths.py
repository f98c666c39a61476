"""TRL settings a cloud run's nodes read as paths, judged here before anything is sent.

On a node the ranks start in the workdir SkyPilot uploaded (the recipe's, this checkout), so a relative
model_name_or_path, dataset_name, chat_template_path, resume_from_checkpoint or reward model is read from the upload:
one written as a path (./, ../, a .jinja template) that is not in the workdir, lies outside it, or lies under a
folder the upload leaves out (.skyignore, else .gitignore: outputs/ holds local runs) stopped the nodes after
provisioning (the rehearsal swaps the model and data for tiny ones, so it could not tell). A value that is not written
as a path and is not in the workdir is a Hub id. An absolute path is the nodes' own (an image's, a mount's): one that
lies on this machine and under none of the task's mounts is said in a note, not refused.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from orchestrator.core.errors import OrchError
from orchestrator.launch.resolved import Launch

READ = ("model_name_or_path", "dataset_name", "chat_template_path", "resume_from_checkpoint",
        "reward_model_name_or_path")  # fmt: skip


def left_out(workdir: Path) -> tuple[str, list[str]]:
    """(the file, its patterns) SkyPilot's upload leaves out: .skyignore where it exists, else .gitignore."""
    for name in (".skyignore", ".gitignore"):
        if (workdir / name).is_file():
            lines = (workdir / name).read_text(errors="replace").splitlines()
            return name, [x.strip().strip("/") for x in lines if x.strip() and not x.lstrip().startswith(("#", "!"))]
    return "", []


def check(launch: Launch) -> list[str]:
    """An OrchError for a path the nodes would not find; the notes to print."""
    workdir, notes = launch.recipe.workdir, []
    mounts = [str(m).rstrip("/") for m in launch.task().get("file_mounts") or {}]
    ignore_file, patterns = left_out(workdir)
    for key in READ:
        value = str(launch.setting(key, "") or "")
        if not value or value.startswith("~"):
            continue
        if value.startswith("/"):
            if not any(value == m or value.startswith(m + "/") for m in mounts) and Path(value).exists():
                notes.append(f"[orch] note: {key}={value} is a path on this machine and under none of the task's "
                             "mounts: the nodes read it from their own disks")  # fmt: skip
            continue
        written = value.startswith(("./", "../")) or (key == "chat_template_path" and value.endswith(".jinja"))
        local = workdir / value
        rel = os.path.relpath(os.path.normpath(workdir.absolute() / value), workdir.absolute())
        parts = Path(rel).parts
        if not written and not local.exists():
            continue  # a Hub id
        if rel == ".." or rel.startswith("../"):
            raise OrchError(f"{key}={value}: outside the workdir ({workdir.resolve()}), which is all SkyPilot uploads "
                            "to the nodes: move it into the workdir, or into a bucket the task mounts")  # fmt: skip
        if not local.exists():
            raise OrchError(f"{key}={value}: no such file or directory in the workdir ({local.resolve()}), which "
                            "SkyPilot uploads to every node; give an existing path or a Hub id (org/name)")  # fmt: skip
        if hit := _left_out(parts, patterns):
            where, pattern = hit
            raise OrchError(f"{key}={value}: {where} is left out of the workdir's upload ({ignore_file}: {pattern}), "
                            "so the nodes would not have it: move it elsewhere in the workdir, or into a bucket the "
                            "task mounts")  # fmt: skip
    return notes


def _left_out(parts: tuple[str, ...], patterns: list[str]) -> tuple[str, str] | None:
    """(the part of the path, the pattern) that leaves it out: a pattern without a slash matches a name at any depth,
    one with a slash the path from the workdir (git's rules, which SkyPilot's upload follows, in their simple form)."""
    names = list(parts)
    for pattern in patterns:
        for depth in range(1, len(names) + 1):
            if "/" in pattern:
                if fnmatch.fnmatch("/".join(names[:depth]), pattern):
                    return "/".join(names[:depth]), pattern
            elif fnmatch.fnmatch(names[depth - 1], pattern):
                return "/".join(names[:depth]), pattern
    return None
