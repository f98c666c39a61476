"""Directories orch may delete: only those it made, marked with the run they were made for.

Every directory orch deletes (`--fresh`'s output dir, a run's reports, the dashboard's cache, a failed pull, a node's
live Trackio database) is made with `claim`, which creates it atomically with a marker file (`.orch-run`, JSON
naming the run) inside, and is deleted only by `remove`, which refuses:
  - a path that is not a directory, or is a symbolic link (it never follows one, at the top or inside);
  - a directory without orch's marker (made by hand, or by an orch from before markers: the error names the path to
    delete by hand), or whose marker names another run;
  - the current directory, the recipe's working directory, any user's home, the file system root, a repository
    root (a directory holding `.git`), or an ancestor of any of them, marked or not.
Everything else that orch writes and never deletes (checkpoints on a bucket, records) needs no marker.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.core.errors import OrchError

MARKER = ".orch-run"
_MARKER_MAX = 4096  # bytes: a marker is a line of JSON; anything larger is not one of ours


def check_name(name: str, what: str = "run name") -> str:
    """A name orch uses as one path component (run names, task ids): not empty, no `/`, not `.` or `..`."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name.encode()) > 200:
        raise OrchError(f"{what} {name[:80]!r} cannot name a directory: use letters, digits, '.', '-' and '_'")
    return name


def claim(path: Path, run: str) -> bool:
    """Make `path` (and its missing parents) as a directory marked for `run`, atomically: it appears with its marker
    or not at all. True if orch made it now or it already carries this run's marker; False if it already existed
    otherwise (it is left as it is, and `remove` will refuse it)."""
    path = Path(path)
    if marker_run(path) == run:
        return True
    if os.path.lexists(path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name[:100]}.", suffix=".claim", dir=path.parent))
    try:
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # as mkdir would make it (mkdtemp's is private)
        (tmp / MARKER).write_text(json.dumps({"orch": 1, "run": run, "made": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        try:
            os.rename(tmp, path)  # a directory appeared meanwhile: not ours (EEXIST/ENOTEMPTY), or empty and now ours
        except OSError:
            return marker_run(path) == run
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def marker_run(path: Path) -> str | None:
    """The run named by the marker of directory `path` (None: not a directory orch marked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return _read_marker(fd)
    finally:
        os.close(fd)


def _read_marker(dir_fd: int) -> str | None:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _MARKER_MAX + 1)
    finally:
        os.close(fd)
    try:
        value = json.loads(data) if len(data) <= _MARKER_MAX else None
    except ValueError:
        return None
    run = value.get("run") if isinstance(value, dict) and value.get("orch") == 1 else None
    return run if isinstance(run, str) and run else None


def protected(also: tuple[Path, ...] = ()) -> set[Path]:
    """Directories never deleted, nor any ancestor of them: the current directory, `also` (a recipe's working
    directory), every user's home, /, and the repository roots at or above each of these."""
    import pwd

    places = {Path.cwd().resolve(), Path.home().resolve(), Path("/")} | {Path(p).resolve() for p in also}
    try:
        places |= {Path(user.pw_dir).resolve() for user in pwd.getpwall() if user.pw_dir.startswith("/")}
    except OSError:
        pass
    for start in list(places):
        for folder in (start, *start.parents):
            if os.path.lexists(folder / ".git"):
                places.add(folder)
    return places


def _protected_kind(real: Path, also: tuple[Path, ...]) -> str:
    """The protected directory (`protected`) that resolved path `real` is or holds, in words ('' when none)."""
    for place in protected(also):
        if place == real or real in place.parents:
            return "the current directory" if place == Path.cwd().resolve() else str(place)
    return ""


def why_not_removable(path: Path, run: str | None, also: tuple[Path, ...] = ()) -> str | None:
    """Why `remove` would refuse `path` (None: it would delete it, or there is nothing there). run None accepts any
    orch marker (a directory of orch's own reports, whatever run wrote them)."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link; orch deletes only directories it made, never through a link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory; orch deletes only directories it made"
    real = path.resolve()
    if kind := _protected_kind(real, also):
        return f"{path} is {kind} or holds it; orch never deletes it"
    if os.path.lexists(real / ".git"):
        return f"{path} is a repository root ({real}/.git); orch never deletes one"
    owner = marker_run(path)
    if owner is None:
        return (
            f"{path} carries no orch marker ({MARKER}): it was made by hand or by an orch older than markers; "
            f"delete it by hand if you mean it (rm -r {_quoted(path)})"
        )
    if run is not None and owner != run:
        return (
            f"{path} was made for run {owner}, not {run}; delete it by hand if you mean it (rm -r {_quoted(path)}), "
            "or choose another directory"
        )
    return None


def why_foreign(path: Path, also: tuple[Path, ...] = (), reports: str = "orch") -> str | None:
    """Why a run may not write into directory `path` (None: it may): a run writes its final model (README.md,
    config.json, model.safetensors, the tokenizer's files) at its top, where same-named files would be overwritten, and
    transformers deletes older checkpoint-* folders there. A run may write into a directory that is not there yet, an
    empty one, or one an orch run made or wrote into (its marker, or its `reports` folder's: a directory the user made
    empty for a run stays unmarked, and orch's reports in it are marked; this run's resumes, another's is the user's
    choice, which the ranks check against its checkpoints' settings); not into what `protected` lists, nor anything
    else that holds files."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        return f"{path} is not a directory"
    real = path.resolve()
    if kind := _protected_kind(real, also):
        return f"{path} is {kind} or holds it"
    if marker_run(real) is not None or marker_run(real / reports) is not None:
        return None
    try:
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in os.scandir(real))
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{path} holds files no orch run made ({shown}) and no orch marker ({MARKER})"


def remove(path: Path, run: str | None, what: str, also: tuple[Path, ...] = ()) -> bool:
    """Delete directory `path` that orch made for `run` (see `why_not_removable`; OrchError naming `what` if it may
    not). Its marker goes last, so an interrupted delete can be finished by the next one. False: nothing was there."""
    path = Path(path)
    why = why_not_removable(path, run, also)
    if why:
        raise OrchError(f"{what}: {why}")
    if not os.path.lexists(path):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if (_read_marker(fd) or None) is None:  # replaced between the check and here
            raise OrchError(f"{what}: {path} changed while orch checked it; nothing deleted")
        for entry in os.scandir(fd):
            if entry.name == MARKER:
                continue
            if entry.is_dir(follow_symlinks=False):
                _rmtree_at(entry.name, fd)
            else:
                os.unlink(entry.name, dir_fd=fd)
        os.unlink(MARKER, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
    return True


def _rmtree_at(name: str, dir_fd: int) -> None:
    """shutil.rmtree of `name` relative to an open directory (symlinks inside are removed, never followed)."""
    if sys.version_info >= (3, 11):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:  # the launch side runs on 3.10 too: by the descriptor's path, which rmtree still walks without following
        shutil.rmtree(os.path.join(f"/proc/self/fd/{dir_fd}", name))


def unmark(path: Path) -> None:
    """Hand a directory orch made over to the user (a pulled model): its marker goes, so orch never deletes it."""
    Path(path, MARKER).unlink(missing_ok=True)


def _quoted(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))
