"""`python bench/suite_census.py [--every S] [--json FILE] -- COMMAND...`: run COMMAND (e.g. `make test`) and say where
this machine's CPU went meanwhile, by kind of process: training ranks, accelerate's launchers, rehearsals, SkyPilot's
API server and its runtime on the bed's nodes, C++ builds, installs...

bench/suite_cpu.py (ORCH_TEST_CPU_DIR) gives each test the CPU of the processes its worker reaped; daemons nobody reaps
(the SkyPilot bed's) and what a fixture starts are missed or land on whichever test reaped them. This samples every
process the machine starts after it, COMMAND's or not (psutil, every `--every` seconds: one that lives less than that
may be missed), and keeps each one's last CPU time, so the kinds add up to what the machine did. Measured with it
(docs/measurements.md): a suite's ranks took 45% of its CPU, and a JIT build of DeepSpeed's pin_memory op, which no
test needed, 100 s."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter

import psutil

KINDS = [  # (kind, pattern on the command line), first match wins
    ("tiny model builds", r"orchestrator\.train\.smoke_build"),
    ("accelerate launch", r"accelerate\.commands\.launch|accelerate launch"),  # before the ranks: it names their module
    ("training ranks", r"-m orchestrator\.train(\s|$)"),
    ("rehearsals", r"orchestrator\.rehearsal"),
    ("SkyPilot on the nodes", r"skypilot-runtime|sky\.skylet"),
    ("SkyPilot's API server", r"sky\.server|SkyPilot:executor"),
    ("sky CLI", r"bin/sky\b"),
    ("orch CLI and node", r"-m orchestrator\b|bin/orch\b"),
    ("C/C++ builds", r"cc1plus|cc1\b|\bninja\b|collect2|\bld\b"),
    ("installs (pip, uv, compileall)", r"\bpip\b|/uv\b|uv-real|compileall"),
    ("Slurm", r"slurm"),
    ("pytest workers", r"-m pytest\b|xdist|execnet"),
]


def kind(cmdline: str) -> str:
    return next((name for name, pattern in KINDS if re.search(pattern, cmdline)), "other")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--json", help="also write every process seen (pid, command line, CPU s) to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    before = {(p.pid, p.info["create_time"]) for p in psutil.process_iter(["create_time"])}
    seen: dict[tuple[int, float], tuple[str, float]] = {}
    started = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        for p in psutil.process_iter(["create_time", "cmdline", "cpu_times"]):
            key = (p.pid, p.info["create_time"])
            if key in before or p.info["cpu_times"] is None:
                continue
            cmdline = " ".join(p.info["cmdline"] or []) or seen.get(key, ("", 0.0))[0]
            seen[key] = (cmdline, p.info["cpu_times"].user + p.info["cpu_times"].system)
        time.sleep(args.every)
    wall = time.monotonic() - started
    cpu, count = Counter[str](), Counter[str]()
    for cmdline, used in seen.values():
        name = kind(cmdline)
        cpu[name] += used
        count[name] += 1
    total = sum(cpu.values())
    print(f"\n{len(seen)} processes, {total:,.0f} s of CPU in {wall:,.0f} s ({total / wall:.2f} cores busy on average)")
    print(f"{'kind':34} {'processes':>9} {'CPU s':>8} {'share':>6}")
    for name, used in cpu.most_common():
        print(f"{name:34} {count[name]:9d} {used:8.0f} {used / total:6.1%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"wall": wall, "processes": [[k[0], c, u] for k, (c, u) in seen.items()]}, fh)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
