"""`orch status`, `orch logs`, `orch cancel`, `orch down`: act on the runs recorded in sky_jobs/.

Views: each asks the backend of the platform the run was launched on (launch/backends): SkyPilot's SDK for a
cluster or managed job, the record, run lock and log file for a local run.
"""

from __future__ import annotations

import argparse

from orchestrator.commands import add, print_table

EXAMPLES = {
    "status": "  orch status                       # every recorded run: state, step, loss, metric, tok/s, ETA, spend\n"
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
        elif name == "logs":
            parser.add_argument("run", help="run name (or a unique prefix), as `orch status` lists it")
        else:  # it stops or tears down something: the full name, never a guess
            parser.add_argument("run", help="the run's full name, as `orch status` lists it")
        if name == "logs":
            parser.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
        parser.set_defaults(func=func)


def status(args: argparse.Namespace) -> int:
    """Every recorded run from its record, as its backend answers for it (a cloud run's backend asks SkyPilot only
    about runs not known to be over). `orch status RUN` refreshes that one run from its live source."""
    from orchestrator.launch import backends, records

    rows = [records.find(args.run)] if args.run is not None else records.all_records()
    if not rows:
        print("no runs recorded in sky_jobs/ yet; start one with `orch run`")
        return 0
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.launch.progress import KEYS

    table = [("RUN", "BACKEND", "STATE", "STEP", "LOSS", "METRIC", "TOK/S", "ETA", "SPENT", "STARTED", "RECIPE")]

    def live(record) -> str:  # a live cloud run's is a request or two to SkyPilot: the runs are asked at once
        return backends.for_record(record).state(record, refresh=bool(args.run))

    with ThreadPoolExecutor(min(8, len(rows))) as pool:
        states = list(pool.map(live, rows))
    for record, state in zip(rows, states, strict=True):
        shown = backends.for_record(record).progress(record)
        cells = [shown.get(key) or "-" for key in KEYS]
        table.append((record.run, record.get("backend"), state, *cells, record.get("time"), record.get("recipe")))
    print_table(table)
    if args.run is not None and rows[0].get("error"):  # why the run failed, as its last line said it
        print(f"error: {rows[0].get('error')}")
    return 0


def logs(args: argparse.Namespace) -> int:
    from orchestrator.launch import backends, records

    record = records.find(args.run)
    return backends.for_record(record).logs(record, follow=args.follow)


def cancel(args: argparse.Namespace) -> int:
    from orchestrator.launch import backends, records

    record = records.find(args.run, exact=True)
    print(backends.for_record(record).cancel(record), flush=True)
    return 0


def down(args: argparse.Namespace) -> int:
    from orchestrator.launch import backends, records

    record = records.find(args.run, exact=True)
    print(backends.for_record(record).down(record), flush=True)
    return 0
