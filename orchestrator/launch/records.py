"""sky_jobs/<run>.yaml: the resolved task of every run, with the run's record in a header comment.

The body is the task exactly as launched (secret values never: only their names, null, so that
`sky launch --secret NAME sky_jobs/<run>.yaml` relaunches it). The header holds `# key: value` lines that
`orch status/logs/cancel/down` read back. Files are written atomically (temp file + rename), and only
after every check of the run passed.

A run's state is a `RunState`; the header keeps it as text (`failed (exit 1)`, or SkyPilot's own word for a live
cloud job, `RECOVERING`), which `RunState.of` reads back, so records of earlier versions read as before. Which
backend answers for a run is its `platform` (`local`, `sky`; records without one: from their `backend` text).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from orchestrator.core import credentials, files
from orchestrator.core.errors import OrchError
from orchestrator.core.owned import check_name
from orchestrator.core.yamlio import dump_task

SKY_JOBS = Path("sky_jobs")
HEADER_KEYS = (
    "run", "recipe", "command", "time", "git", "platform", "backend", "cluster", "job_id", "state", "error", "stopped",
    "output_dir", "pid", "token",
    "relaunches", "relaunched",  # `orch run --resume RUN`: how many, the last one's time
    "step", "loss", "metric", "tok_s", "eta", "spent",  # the last progress `orch status RUN` read (launch/progress.py)
)  # fmt: skip
"""The record's fields, in the order the header lists them."""
_LINE = re.compile(r"^# ([a-z_]+): (.*)$")


class RunState(Enum):
    """Where a run is. `final` states never change again: `orch status` answers for them from the record."""

    LAUNCHING = "launching"  # a cloud launch before SkyPilot answered
    SUBMITTED = "submitted"  # SkyPilot took it
    RUNNING = "running"  # a local run's orch is alive, or SkyPilot says the job is live (PENDING, RECOVERING...)
    IDLE = "idle"  # a cluster is UP with no live job: it costs money until it stops or goes down
    STOPPED = "stopped"  # a cluster autostopped: its disks are kept
    SUCCEEDED = "succeeded"
    STOPPED_EARLY = "stopped early"  # the cost cap ended it cleanly, after a checkpoint
    FAILED = "failed"
    FAILED_TO_LAUNCH = "failed to launch"
    INTERRUPTED = "interrupted"
    INTERRUPTED_LAUNCHING = "interrupted while launching"
    CANCELLED = "cancelled"
    DOWN = "down"
    NOT_FOUND = "not found"
    UNKNOWN = "?"

    @property
    def final(self) -> bool:
        return self in _FINAL

    @classmethod
    def of(cls, text: str) -> RunState:
        """The state a record's `state:` text says, in orch's words (`failed (exit 1)`) or SkyPilot's (`RECOVERING`,
        `cluster UP, IDLE at ...`)."""
        text = text.strip()
        for state in sorted(cls, key=lambda s: -len(s.value)):  # `failed to launch` before `failed`
            if text == state.value or text.startswith(state.value + " ("):
                return state
        for word in sorted(_SKYPILOT, key=len, reverse=True):  # `cluster UP, IDLE` before `cluster UP`
            if text == word or text.startswith((word + ",", word + " ", word + "_")):
                return _SKYPILOT[word]
        return cls.UNKNOWN

    def text(self, detail: str = "") -> str:
        """What the record's header says: the state, and what it came from in parentheses."""
        return f"{self.value} ({detail})" if detail else self.value


_FINAL = {RunState.SUCCEEDED, RunState.STOPPED_EARLY, RunState.FAILED, RunState.FAILED_TO_LAUNCH,
          RunState.INTERRUPTED, RunState.INTERRUPTED_LAUNCHING, RunState.CANCELLED, RunState.DOWN,
          RunState.NOT_FOUND}  # fmt: skip
# SkyPilot's job and managed-job statuses (sky.JobStatus, sky.jobs.ManagedJobStatus) and orch's `cluster X` words for a
# cluster's (sky.ClusterStatus); a FAILED_* status reads as FAILED.
_SKYPILOT = {
    **dict.fromkeys(("INIT", "PENDING", "SUBMITTED", "STARTING", "SETTING_UP", "RUNNING", "RECOVERING",
                     "CANCELLING", "cluster UP"), RunState.RUNNING),  # fmt: skip
    "SUCCEEDED": RunState.SUCCEEDED, "FAILED": RunState.FAILED, "CANCELLED": RunState.CANCELLED,
    "cluster UP, IDLE": RunState.IDLE, "cluster STOPPED": RunState.STOPPED, "cluster INIT": RunState.RUNNING,
    "cluster down": RunState.DOWN,
}  # fmt: skip


@dataclass
class Record:
    run: str
    task: dict
    meta: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = field(default=(), repr=False)
    """Secret values of this run, never written: `render` masks each wherever it would appear (an error quoted)."""

    @property
    def path(self) -> Path:
        return SKY_JOBS / f"{self.run}.yaml"

    def get(self, key: str, default: str = "") -> str:
        return self.meta.get(key, default)

    @property
    def state(self) -> RunState:
        return RunState.of(self.meta.get("state", "?"))

    def set_state(self, state: RunState | str, detail: str = "", **meta: str) -> None:
        """Record a state (a RunState, or a live platform's own word for it) and any other header fields."""
        self.meta.update(meta, state=state.text(detail) if isinstance(state, RunState) else state)

    @property
    def platform(self) -> str:
        """The backend that answers for this run (launch/backends): `local` or `sky` for every record so far."""
        return self.meta.get("platform") or ("local" if self.get("backend").startswith("local") else "sky")


def new(run: str, task: dict, recipe_path, command: str, secrets: Iterable[str] = (), **meta: str) -> Record:
    """A record stamped with the time and the git commit of the working tree."""
    stamp = {
        "run": run,
        "recipe": str(recipe_path),
        "command": command,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_commit(),
    }
    return Record(run, task, {**stamp, **meta}, tuple(secrets))


def git_commit(cwd: Path = Path(".")) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def render(record: Record) -> str:
    lines = [
        "# orch run record. This file is a SkyPilot task: from the repository root,",
        f"#   sky launch {record.path}" + "".join(f" --secret {s}" for s in (record.task.get("secrets") or {})),
        "# relaunches the run as it ran.",
    ]
    for key in HEADER_KEYS:
        if record.meta.get(key):
            value = str(record.meta[key]).replace("\n", " ")
            lines.append(f"# {key}: {value}")
    body = dump_task(record.task)
    return credentials.Mask(record.secrets)("\n".join(lines) + "\n\n" + body)


def write(record: Record, create: bool = False) -> Path:
    """Atomically (re)write sky_jobs/<run>.yaml. With `create`, the record must be new: two launches that chose the
    same name cannot both own it (the file appears whole, by a hard link that fails when the name exists)."""
    check_name(record.run)
    SKY_JOBS.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{record.run}.", suffix=".tmp", dir=SKY_JOBS)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(render(record))
        if create:
            try:
                os.link(tmp, record.path)
            except FileExistsError:
                raise OrchError(f"run {record.run} is already recorded in {record.path}: another launch took its "
                                "name; run the command again") from None  # fmt: skip
            os.unlink(tmp)
        else:
            os.replace(tmp, record.path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return record.path


def new_run_name(recipe: str) -> str:
    """A cloud run's name, unique by construction: the recipe, the second it started and 4 random hex digits (two
    launches in one second, from two terminals or a script, get two names; `write(create=True)` backs it up)."""
    import secrets

    return f"{recipe.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def read(path: Path) -> Record:
    text = files.read_text(path, "run record")
    meta = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        match = _LINE.match(line)
        if match:
            meta[match.group(1)] = match.group(2)
    run = meta.get("run", path.stem)
    if run != path.stem:  # the name `orch dashboard` and `orch pull` make directories with: the file's own
        raise ValueError(f"its header names run {run[:80]!r}, its file name {path.stem[:80]!r}")
    check_name(run)
    task = files.parse_yaml(text, f"run record {path}") or {}
    return Record(run=run, task=task, meta=meta)


def all_records(warn: bool = True) -> list[Record]:
    """Every readable record, oldest first; a file that is not one (truncated, binary, hand-edited) is skipped with
    a warning on stderr."""
    import sys

    if not SKY_JOBS.is_dir():
        return []
    records = []
    for path in sorted(SKY_JOBS.glob("*.yaml")):
        try:
            record = read(path)
            if not isinstance(record.task, dict):
                raise ValueError("its body is not a task mapping")
        except Exception as exc:  # YAML errors, bad bytes, a directory named *.yaml
            reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            if warn:
                print(f"[orch] warning: skipping {path}: not a readable run record ({reason})", file=sys.stderr)
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.get("time"))


def find(run: str, exact: bool = False) -> Record:
    """The run named `run`, or the one run whose name starts with it. `exact` (commands that stop, tear down or
    relaunch something) takes only the full name and says which run a prefix would have meant."""
    if not run.strip():
        raise OrchError("an empty run name matches no run: give a run name (or a unique prefix) from `orch status`")
    path = SKY_JOBS / f"{run}.yaml"
    if len(path.name) > 255 or "/" in run:
        raise OrchError(f"no run {run[:80]!r} in {SKY_JOBS}/; `orch status` lists the runs")
    if path.exists():  # read() says what it is when it is no regular file
        try:
            return read(path)
        except Exception as exc:  # YAML errors, bad bytes, a header naming another run
            reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise OrchError(f"{path} is not a readable run record ({reason}); delete it or restore it") from None
    runs = [r.run for r in all_records(warn=False)]
    prefixed = [r for r in runs if r.startswith(run)]
    if len(prefixed) == 1 and exact:
        raise OrchError(f"no run named exactly {run!r}; this command takes the full name: {prefixed[0]}")
    if len(prefixed) == 1:
        return find(prefixed[0])
    hint = f"; matches {', '.join(prefixed)}" if prefixed else ""
    raise OrchError(f"no run {run!r} in {SKY_JOBS}/{hint}; `orch status` lists the runs")
