"""TRL settings a cloud run's nodes read as paths, judged here before anything is sent.

On a node the ranks start in the workdir SkyPilot uploaded (the recipe's, this checkout), so a relative
model_name_or_path, dataset_name, chat_template_path, resume_from_checkpoint or reward model is read from the upload:
one written as a path (./, ../, a .jinja template) that is not in the workdir, lies outside it, or lies under a
folder the upload leaves out (.skyignore, else .gitignore: outputs/ holds local runs) stopped the nodes after
provisioning (the rehearsal swaps the model and data for tiny ones, so it could not tell). What the upload takes is
asked of rsync itself, with the filter SkyPilot's command runner gives it (`.skyignore`, else every folder's
`.gitignore` and .git/info/exclude, merged as rsync merges them; a symlink copied as a link): a file a nested
.gitignore leaves out, or a folder that is a link to elsewhere, arrives missing or dangling. A value that is not written
as a path and is not in the workdir is a Hub id. An absolute path is the nodes' own (an image's, a mount's): one that
lies on this machine and under none of the task's mounts is said in a note, not refused.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
from pathlib import Path

from orchestrator.core.errors import OrchError
from orchestrator.launch.resolved import Launch

# what SkyPilot's command runner gives rsync for a workdir upload (sky/utils/command_runner.py's RSYNC_FILTER_SKYIGNORE,
# RSYNC_FILTER_GITIGNORE, GIT_EXCLUDE; tests/test_sky_backend.py compares them with the installed SkyPilot's)
RSYNC_FILTER = {".skyignore": "--filter=dir-merge,- .skyignore", ".gitignore": "--filter=dir-merge,- .gitignore"}
GIT_EXCLUDE = ".git/info/exclude"
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
        hit, asked = _left_out(parts, patterns), uploaded(workdir, Path(rel))
        if asked is None:  # no rsync here: git's rules in their simple form
            asked = (hit[0], "") if hit else ()
        if asked:
            where, why = asked if not hit or asked[1].startswith("a link") else (hit[0], f"{ignore_file}: {hit[1]}")
            raise OrchError(f"{key}={value}: {where} is left out of the workdir's upload ({why}), so the nodes "
                            "would not have it: move it elsewhere in the workdir, or into a bucket the task "
                            "mounts")  # fmt: skip
    return notes


def uploaded(workdir: Path, rel: Path) -> tuple[str, ...] | None:
    """(the first path under `rel` that SkyPilot's rsync of the workdir leaves out or sends as a link to outside it,
    why), or () when the nodes get all of it: rsync itself lists `rel` with the filter SkyPilot's command runner
    passes, against the files here. None where rsync cannot tell (not installed: SkyPilot's upload fails there too)."""
    if shutil.which("rsync") is None:
        return None
    src = workdir.resolve()
    skyignore = (src / ".skyignore").exists()
    argv = ["rsync", "-r", "-l", "-8", "--list-only", RSYNC_FILTER[".skyignore" if skyignore else ".gitignore"]]
    if not skyignore and (src / GIT_EXCLUDE).exists():
        argv.append(f"--exclude-from={src / GIT_EXCLUDE}")
    # after the ignore rules (the first rule that matches wins): `rel`'s folders, `rel` and all under it; nothing else.
    # A name's own wildcard characters are escaped, as rsync reads a backslash where a pattern holds a wildcard
    parts = [re.sub(r"([*?\[\\])", r"\\\1", part) for part in rel.parts]
    argv += [f"--include=/{'/'.join(parts[:n])}/" for n in range(1, len(parts))]
    argv += [f"--include=/{'/'.join(parts)}", f"--include=/{'/'.join(parts)}/***", "--exclude=*", f"{src}/"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return None
    listed = {}
    for line in done.stdout.splitlines():
        fields = line.split(None, 4)
        if len(fields) == 5:
            listed[fields[4].partition(" -> ")[0]] = fields[0][0]
    rules = ".skyignore" if skyignore else "the .gitignore of each folder and .git/info/exclude"
    for path in _here(src, rel):
        kind = listed.get(path.as_posix())
        if kind is None:
            return path.as_posix(), f"SkyPilot's rsync, by {rules}"
        real = (src / path).resolve()
        if kind == "l" and real != src and src not in real.parents:
            return path.as_posix(), f"a link to {real}, outside it: SkyPilot's rsync copies the link, not what it names"
    return ()


def _here(src: Path, rel: Path) -> list[Path]:
    """`rel` and, for a folder, what lies under it (a link not followed), relative to `src`."""
    paths = [rel]
    if (src / rel).is_dir() and not (src / rel).is_symlink():
        for top, dirs, files in os.walk(src / rel):
            dirs.sort()
            paths += [Path(top, name).relative_to(src) for name in sorted(dirs) + sorted(files)]
    return paths


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
