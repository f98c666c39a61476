"""`orch status`, `orch logs`, `orch cancel`, `orch down`: act on the runs recorded in sky_jobs/.

Each maps to the SkyPilot SDK call for what the record says was launched (a cluster job or a managed job);
local runs answer from their record and log file.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from orchestrator.commands import add, print_table
from orchestrator.core.errors import OrchError

if TYPE_CHECKING:
    from orchestrator.launch import records

EXAMPLES = {
    "status": "  orch status                       # every recorded run: state, step, loss, tok/s, ETA, spend\n"
    "  orch status phi3-dpo-fsdp-20261122-101500   # one run, refreshed from SkyPilot's state and logs",
    "logs": "  orch logs phi3-dpo-fsdp-20261122-101500 --follow   # stream a run's logs\n"
    "  orch logs phi3_dpo_fsdp-8a463d72                   # a local run's log",
    "cancel": "  orch cancel phi3-dpo-fsdp-20261122-101500   # cancel the job (the cluster stays up)\n"
    "  orch cancel phi3_dpo_fsdp-8a463d72          # a live local run: its orch stops every node",
    "down": "  orch down phi3-dpo-fsdp-20261122-101500     # tear the cluster down (a managed job: cancel it)",
}
HELP = {
    "status": "list recorded runs and their state",
    "logs": "print (or --follow) a run's logs",
    "cancel": "cancel a run's job (a local run: stop it)",
    "down": "tear down a run's cluster (a local run: stop it)",
}


def register(sub: argparse._SubParsersAction) -> None:
    for name, func in (("status", status), ("logs", logs), ("cancel", cancel), ("down", down)):
        parser = add(
            sub,
            name,
            help=HELP[name],
            description=HELP[name].capitalize() + ".",
            epilog="examples:\n" + EXAMPLES[name],
        )
        if name == "status":
            parser.add_argument("run", nargs="?", help="refresh this run (or a unique prefix) from its live source")
        else:
            parser.add_argument("run", help="run name (or a unique prefix), as `orch status` lists it")
        if name == "logs":
            parser.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
        parser.set_defaults(func=func)


def _is_local(record: records.Record) -> bool:  # noqa: F821 - annotation only
    return record.get("backend").startswith("local")


def local_state(record: records.Record) -> str:  # noqa: F821 - annotation only
    """A local run's state. One recorded `running` whose lock nobody holds lost its orch (SIGKILL, a crash): what
    is left of it is killed (processes carrying its launch token) and the record says so."""
    from orchestrator.launch import records, runlock

    state = record.get("state", "?")
    if state != "running" or runlock.held(record.get("output_dir")):
        return state
    reaped = runlock.reap(record.get("token"))
    state = f"interrupted (orch pid {record.get('pid', '?')} ended without recording it" + (
        f"; reaped {len(reaped)} leftover process(es))" if reaped else "; no process of it was left)"
    )
    record.meta["state"] = state
    records.write(record)
    return state


# A cloud run in one of these states stays there: `orch status` answers from its record without asking SkyPilot.
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "cluster down", "failed to launch", "interrupted while launching",
         "cancelled", "down", "not found")  # fmt: skip


def _cloud_state(record: records.Record, refresh: bool) -> str:  # noqa: F821 - annotation only
    """A cloud run's state: SkyPilot's live answer for a run not known to be over (kept in its record), else the
    recorded one. With `refresh`, also its progress, from the last step line in SkyPilot's logs."""
    from orchestrator.launch import progress, records
    from orchestrator.launch.backends import sky as sky_backend

    state = record.get("state", "?")
    if not record.get("job_id", "").isdigit() or (state.startswith(FINAL) and not refresh):
        return state
    try:
        state = sky_backend.state(record)
        if refresh:
            record.meta.update(progress.from_lines(sky_backend.recent_output(record)))
    except OrchError as exc:  # SkyPilot API unreachable, no credentials, ...: the recorded state
        return f"{state} (live state unavailable: {str(exc).split(': ')[1] if ': ' in str(exc) else exc})"
    record.meta["state"] = state
    records.write(record)
    return state


def status(args: argparse.Namespace) -> int:
    """Every recorded run from its record (and a local run's log); SkyPilot is asked only about cloud runs not known
    to be over. `orch status RUN` refreshes that one run from its live source."""
    from pathlib import Path

    from orchestrator.launch import progress, records

    rows = [records.find(args.run)] if args.run else records.all_records()
    if not rows:
        print("no runs recorded in sky_jobs/ yet; start one with `orch run`")
        return 0
    table = [("RUN", "BACKEND", "STATE", "STEP", "LOSS", "TOK/S", "ETA", "SPENT", "STARTED", "RECIPE")]
    for record in rows:
        if _is_local(record):
            state = local_state(record)
            shown = progress.from_log(Path(record.get("output_dir")) / "orch" / "log.jsonl")
        else:
            state = _cloud_state(record, refresh=bool(args.run))
            shown = {key: record.get(key) for key in progress.KEYS}
        cells = [shown.get(key) or "-" for key in progress.KEYS]
        table.append((record.run, record.get("backend"), state, *cells, record.get("time"), record.get("recipe")))
    print_table(table)
    return 0


def logs(args: argparse.Namespace) -> int:
    from orchestrator.launch import records

    record = records.find(args.run)
    if _is_local(record):
        from pathlib import Path

        log = Path(record.get("output_dir")) / "orch" / "run.log"
        if not log.is_file():
            raise OrchError(f"run {record.run} has no log at {log}; rerun it with `{record.get('command')}`")
        print(log.read_text(), end="")
        return 0
    from orchestrator.launch.backends import sky as sky_backend

    return sky_backend.logs(record, follow=args.follow)


def _stop_local(record: records.Record, verb: str) -> int:  # noqa: F821 - annotation only
    """cancel/down of a local run: SIGTERM to its orch, which stops every node and records `interrupted`."""
    import os
    import signal
    import time

    state = local_state(record)
    if state != "running":
        raise OrchError(f"run {record.run} ran locally and is not running ({state}): there is nothing to {verb}")
    pid = int(record.get("pid"))
    os.kill(pid, signal.SIGTERM)
    print(f"[orch] sent SIGTERM to orch (pid {pid}) of {record.run}; it stops its nodes", flush=True)
    from orchestrator.launch import runlock

    deadline = time.monotonic() + 30
    while runlock.held(record.get("output_dir")) and time.monotonic() < deadline:
        time.sleep(0.2)
    if runlock.held(record.get("output_dir")):
        raise OrchError(f"run {record.run} is still stopping after 30 s; `orch status` shows when it has ended")
    print(f"[orch] stopped {record.run}")
    return 0


def cancel(args: argparse.Namespace) -> int:
    from orchestrator.launch import records

    record = records.find(args.run)
    if _is_local(record):
        return _stop_local(record, "cancel")
    from orchestrator.launch.backends import sky as sky_backend

    sky_backend.cancel(record)
    record.meta["state"] = "cancelled"
    records.write(record)
    print(f"[orch] cancelled {record.run}")
    return 0


def down(args: argparse.Namespace) -> int:
    from orchestrator.launch import records

    record = records.find(args.run)
    if _is_local(record):
        return _stop_local(record, "tear down")
    from orchestrator.launch.backends import sky as sky_backend

    sky_backend.down(record)
    record.meta["state"] = "down" if record.get("cluster") else "cancelled"
    records.write(record)
    print(
        f"[orch] {'tore down cluster ' + record.get('cluster') if record.get('cluster') else 'cancelled'} "
        f"({record.run})"
    )
    return 0
