"""`orch dashboard RUN`: every node's Trackio database of a `--track` run, merged, in Trackio's dashboard.

Each node wrote its own database (orchestrator/train/tracking.py) and copied it to <output_dir>/trackio/node<N>/.
A local run's output dir is here; a cluster run's is fetched from its head node with rsync over the SSH alias
SkyPilot writes for the cluster; any other copy (a bucket synced by hand) is named with --dir.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.commands import add
from orchestrator.core.errors import OrchError

EPILOG = """\
examples:
  orch run qwen25_sft_ddp --local --nodes 2 --smoke --track   # a tracked run
  orch dashboard qwen25_sft_ddp-5445463c                      # merge its nodes' curves and open Trackio
  orch dashboard qwen25_sft_ddp-5445463c --no-open            # merge only; print where and how to open it
  orch dashboard RUN --dir ./from-bucket/RUN-OUTPUT           # a copy you synced (e.g. aws s3 sync s3://BUCKET/..)
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "dashboard",
        help="merge a --track run's per-node Trackio curves and open Trackio's dashboard",
        description="Merge the Trackio databases every node of a --track run wrote and open Trackio's dashboard.",
        epilog=EPILOG,
    )
    parser.add_argument("run", help="run name (or a unique prefix), as `orch status` lists it")
    parser.add_argument("--dir", type=Path, help="the run's output dir (or a copy of it) instead of where it ran")
    parser.add_argument("--no-open", action="store_true", help="merge and print the command; do not start Trackio")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from orchestrator.core import home, owned
    from orchestrator.core import trackio_files as tracking
    from orchestrator.launch import backends, records

    record = records.find(args.run)
    work = home.cache_dir() / "dashboards" / record.run
    if args.dir is not None:
        output_dir = args.dir
    else:
        instead = "sync its output dir from the checkpoint bucket and give it with --dir"
        output_dir = backends.for_record(record).output(record, "trackio", work / "fetched", otherwise=instead)
    found = tracking.node_databases(output_dir)
    if not found:
        raise OrchError(
            f"no Trackio curves in {output_dir}/trackio/: run {record.run} was not tracked (rerun it with --track) "
            "or saved no checkpoint yet"
        )
    (project, databases), *others = found.items()
    if others:
        raise OrchError(f"{output_dir}/trackio/ holds several projects ({', '.join(found)}); keep one")
    for db in list(databases):  # a damaged node copy is left out, said; the other nodes' curves are still shown
        if why := tracking.unreadable(db):
            print(f"[orch] warning: leaving out {db}: {why}", flush=True)
            databases.remove(db)
    if not databases:
        raise OrchError(f"no readable Trackio database in {output_dir}/trackio/: each is damaged (see above)")
    merged_dir = work / "trackio"
    owned.remove(merged_dir, record.run, "orch dashboard's merged curves")  # the last merge of this run, if any
    owned.claim(merged_dir, record.run)
    tracking.merge(databases, merged_dir / f"{project}.db")
    print(f"[orch] merged {len(databases)} node(s) of project {project!r} into {merged_dir}", flush=True)
    trackio = Path(sys.executable).parent / "trackio"
    command = f"TRACKIO_DIR={merged_dir} {trackio} show --project {project}"
    if args.no_open:
        print(f"[orch] open it with: {command}")
        return 0
    if not trackio.exists():
        raise OrchError("trackio is not installed here: pip install 'orch[track]' (or `make install`)")
    print(f"[orch] {command}", flush=True)
    env = {**os.environ, "TRACKIO_DIR": str(merged_dir)}
    return subprocess.call([str(trackio), "show", "--project", project], env=env)
