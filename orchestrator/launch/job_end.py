"""How a followed SkyPilot job ended, in orch's last line (the launch side; SkyPilot is not imported here).

`orch run` without --detach, and `orch logs RUN`, stream the job's log through SkyPilot's SDK (`tail_logs`, whose
`output_stream` gets every line). `Follow` passes each line on unchanged and keeps what orch's nodes said about a
failure: each node's last line (`[orch] failed on node N: ...`, node/output.verdict) and its first error lines. The
stream ends with SkyPilot's job driver's summary (`ERROR: Job 1 failed with return code list: [1, 137] ...`), which
quotes nothing a user can act on, and the SDK answers an exit code of its own (sky.exceptions.JobExitCode). `ended`
turns that code and what the nodes said into one line quoting the first real error, as a local run ends, and the
exit code a local run's node would have given (1, or 75 for a network or GPU failure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from orchestrator.core.errors import EXIT_RETRYABLE, retryable
from orchestrator.node.output import STALLED, VERDICT, ErrorLines, first_error, printable

# sky.exceptions.JobExitCode (SkyPilot 0.14): what tail_logs answers for the job it streamed
SUCCEEDED, FAILED, NOT_FINISHED, NOT_FOUND, CANCELLED = 0, 100, 101, 102, 103
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# SkyPilot's prefix of a node's line: `(head, rank=0, pid=2104) `, `(worker1, rank=1, pid=2190) `, `(setup pid=2041) `
_PREFIX = re.compile(r"^\((?P<who>[^()]*?)(?:,? pid=\d+)?\) ?")


@dataclass
class Said:
    """What one node (one SkyPilot prefix) said about a failure."""

    errors: ErrorLines = field(default_factory=ErrorLines)
    verdict: str = ""  # the error its last line quotes ('' when it quoted none)
    verdict_exits: int | None = None
    failed: bool = False  # it printed a verdict


class Follow:
    """A text stream for SkyPilot's `output_stream`: writes through to `sink` and reads each line as it passes."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self.partial = ""
        self.nodes: dict[str, Said] = {}  # by SkyPilot's prefix, in the order they first spoke

    def write(self, text: str) -> int:
        self.sink.write(text)
        self.partial += text
        *lines, self.partial = self.partial.split("\n")
        for line in lines:
            self.line(line)
        return len(text)

    def flush(self) -> None:
        self.sink.flush()
        if self.partial.endswith("\r"):  # a progress bar's line: nothing to read
            self.partial = ""

    def line(self, raw: str) -> None:
        # colours off, and no control byte of the stream reaches orch's own line or the record
        text = printable(_ANSI.sub("", raw).split("\r")[-1]).replace("\x1b", "\ufffd").rstrip()
        match = _PREFIX.match(text)
        who, body = (match.group("who"), text[match.end() :]) if match else ("", text)
        said = self.nodes.setdefault(who, Said())
        if verdict := VERDICT.match(body.strip()):
            said.failed, said.verdict = True, verdict.group("error") or ""
            said.verdict_exits = int(verdict.group("exits")) if verdict.group("exits") else None
        else:
            said.errors.feed(body)

    def first_error(self) -> tuple[str, bool]:
        """The error to quote and whether it is the cluster's (retryable): a failing node's own verdict that is not a
        network failure first (the others' network errors follow from it), then any node's first error. A verdict says
        itself whether it is retryable (`orch exits 75`: its text may quote a network error a rank leaving caused); a
        stall the watchdog ended is retryable, as the node's exit 75 says."""
        quoted = []
        for said in self.nodes.values():
            if said.failed:
                quoted.append((said.verdict or first_error(said.errors), said.verdict_exits is not None))
        if not quoted:
            quoted = [(error, retryable(error) or error.startswith(STALLED))
                      for said in self.nodes.values() if (error := first_error(said.errors))]  # fmt: skip
        return next((q for q in quoted if not q[1]), quoted[0] if quoted else ("", False))


def ended(code: int, follow: Follow, run: str, job: str, following: bool = True) -> tuple[int, str]:
    """orch's exit code and last line ('': nothing to add) for SkyPilot's exit code of a streamed job; `following`:
    the stream was to last until the job's end (a job still running then is an error, else it is what was asked)."""
    if code == SUCCEEDED:
        return 0, ""
    if code == CANCELLED:
        return 1, f"[orch] run {run}: {job} was cancelled"
    if code == NOT_FINISHED:
        return int(following), f"[orch] run {run}: {job} is still running; `orch logs {run} --follow` follows it"
    if code == NOT_FOUND:
        return 1, f"[orch] run {run}: SkyPilot has no {job} (its cluster was torn down or relaunched)"
    error, cluster_failed = follow.first_error()
    quoted = f": {error}" if error else " (its log above quotes no error line)"
    return (EXIT_RETRYABLE if cluster_failed else 1), f"[orch] run {run}: {job} failed{quoted}"


def job_name(record) -> str:
    cluster = record.get("cluster")  # none for a managed job: its clusters are SkyPilot's
    if cluster:
        return f"SkyPilot's job {record.get('job_id')} on cluster {cluster}"
    return f"SkyPilot's managed job {record.get('job_id')}"


def failure(record, text: str) -> str:
    """What a failed job's log (its last lines will do: each node's verdict is among them) says, for the record."""
    import io

    follow = Follow(io.StringIO())
    follow.write(text if text.endswith("\n") else text + "\n")
    if not follow.first_error()[0]:
        return f"{job_name(record)} failed (no error line among its log's last lines: `orch logs {record.run}`)"
    return ended(FAILED, follow, record.run, job_name(record))[1].split(": ", 1)[1]


def close(record, code: int, stream: Follow, write: bool = True, following: bool = True) -> int:
    """Print orch's last line for a streamed job's end and answer orch's exit code. `write`: a failed job's line goes
    into the record's `error`, read again first (`orch cancel` from another terminal may have written it meanwhile);
    its state stays SkyPilot's, which `orch status` asks: a failed job's cluster may still be up and billed."""
    import dataclasses

    from orchestrator.launch import records

    exit_code, line = ended(code, stream, record.run, job_name(record), following)
    if line:
        print(line, flush=True)
    if write and code == FAILED and record.path.is_file():
        now = dataclasses.replace(records.read(record.path), secrets=record.secrets)
        now.meta["error"] = line.split(": ", 1)[1]
        records.write(now)
    return exit_code
