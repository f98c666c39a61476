#!/usr/bin/env python3
"""A recipe as a task for a Slurm cluster, for plain `sky launch` (no orch installed on the laptop):

    python3 scripts/on-slurm.py recipes/phi3_dpo_fsdp.yaml > /tmp/phi3_slurm.yaml
    sky launch /tmp/phi3_slurm.yaml --infra slurm/<cluster> -c my-run

Every recipe mounts a cloud bucket at CHECKPOINT_ROOT (file_mounts, mode MOUNT_CACHED): durable checkpoints on a
cloud, where a cluster's disks go with it. A Slurm cluster has no object store SkyPilot can mount, and `--env` cannot
remove a mount, so this prints the same task without the bucket and with CHECKPOINT_ROOT on the cluster's shared file
system (default `~/orch-checkpoints`: the login account's home, which Slurm's nodes share; `~` is that account's home
on the nodes, not SkyPilot's per-cluster $HOME). Everything else is the recipe's. It reads the repository's own
orchestrator/launch/storage.py (standard library and PyYAML, which SkyPilot installs): nothing to install.
`orch run --infra slurm/...` does the same by itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's orchestrator, not an installed one
from orchestrator.launch.storage import SLURM_ROOT, slurm_task  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a recipe as a Slurm task (shared-filesystem checkpoints).")
    parser.add_argument("recipe", help="a recipe YAML, e.g. recipes/phi3_dpo_fsdp.yaml")
    parser.add_argument("--checkpoint-root", default=SLURM_ROOT, help=f"a shared path (default {SLURM_ROOT})")
    args = parser.parse_args(argv)
    try:
        with open(args.recipe) as fh:
            text = fh.read()
    except OSError as exc:
        print(f"on-slurm: error: {args.recipe}: {exc.strerror}", file=sys.stderr)
        return 2
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))  # the recipe's own words
    task = yaml.safe_load(text)
    if not isinstance(task, dict) or "run" not in task:
        print(f"on-slurm: error: {args.recipe} is not a recipe (a SkyPilot task with run:)", file=sys.stderr)
        return 2
    sys.stdout.write(f"# {args.recipe} for a Slurm cluster (scripts/on-slurm.py): no bucket, checkpoints under "
                     f"{args.checkpoint_root}\n{header}")  # fmt: skip
    sys.stdout.write(yaml.safe_dump(slurm_task(task, args.checkpoint_root), sort_keys=False, width=1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
