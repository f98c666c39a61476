"""`python bench/suite_cpu.py DIR`: where a test run's CPU went, from `make test` run with ORCH_TEST_CPU_DIR=DIR
(tests/conftest.py writes each test's wall and CPU time there): the totals, each module's sum, the costliest tests.

This machine's cores are busy through the whole suite (/proc/stat), so its wall time follows its CPU work: these
figures say what to cut. Daemons no pytest worker reaps (the SkyPilot bed's) are not counted."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: str, top: int = 25) -> int:
    rows = [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        print(f"suite_cpu: no records in {folder}: run `ORCH_TEST_CPU_DIR={folder} make test` first", file=sys.stderr)
        return 2
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        module = by_module[row["id"].split("::")[0]]
        module[0] += 1
        module[1] += row["wall"]
        module[2] += row["cpu"]
    print(f"{len(rows)} tests: {sum(r['wall'] for r in rows):,.0f} s of workers' wall time, "
          f"{sum(r['cpu'] for r in rows):,.0f} s of CPU")  # fmt: skip
    print(f"\n{'module':48} {'tests':>5} {'wall s':>8} {'CPU s':>8}")
    for name, (count, wall, cpu) in sorted(by_module.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"{name:48} {count:5.0f} {wall:8.0f} {cpu:8.0f}")
    print(f"\n{'test':100} {'wall s':>7} {'CPU s':>7}")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{row['id'][:100]:100} {row['wall']:7.1f} {row['cpu']:7.1f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python bench/suite_cpu.py DIR (the ORCH_TEST_CPU_DIR of a test run)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
