"""`make test`'s scheduling (tests/solo_group.py): under `-n 3 --dist loadgroup --solo-group NAME` the group NAME
runs on a worker of its own that takes nothing else, the other workers take everything else, every test runs once.

A nested pytest on a small project of its own, with this suite's conftest loaded as a plugin (`-p conftest`): the
same option, scheduler hook and xdist_group fix `make test` runs with; each test writes down its worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.cli


def module(tier: str, group: str, name: str, count: int, seconds: float) -> str:
    """A test module of `count` tests of `seconds` each, of `tier` and in xdist_group `group` (none if empty)."""
    marks = f"[pytest.mark.{tier}" + (f", pytest.mark.xdist_group({group!r})]" if group else "]")
    head = f"import pytest\nfrom ran import record\npytestmark = {marks}\n"
    return head + f"@pytest.mark.parametrize('n', range({count}))\ndef {name}(n, record): record(n, {seconds})\n"


PROJECT = {
    # the group that mostly waits (the Slurm bed's stand-in), first as in the suite's heavy-first order; the free tests
    # outlast it, so xdist's own loadgroup would hand its worker some of them
    "test_waits.py": module("e2e", "beside", "test_waits", 3, 0.3),
    "test_grouped.py": module("e2e", "module", "test_grouped", 3, 0.2),
    "test_free.py": module("unit", "", "test_free", 12, 0.2),
    # not a conftest.py: `-p conftest` would import the project's, first on sys.path, rather than the suite's
    "ran.py": "import json, os, time\nimport pytest\n\n@pytest.fixture\ndef record(request):\n"
    "    def done(n, seconds):\n        time.sleep(seconds)\n"
    "        with open(os.environ['RAN_LOG'], 'a') as fh:\n"
    "            fh.write(json.dumps([request.node.name, os.environ['PYTEST_XDIST_WORKER']]) + '\\n')\n"
    "    return done\n",
}


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    project = tmp_path / "project"
    project.mkdir()
    for name, text in PROJECT.items():
        (project / name).write_text(text)
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    unit\n    cli\n    e2e\n    root\n")
    log = tmp_path / "ran.jsonl"
    env = {**os.environ, "RAN_LOG": str(log), "PYTHONPATH": str(ROOT / "tests")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                             "--dist", "loadgroup", *args], cwd=project, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    ran = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert len(ran) == len({name for name, _ in ran}), ran  # each test once
    return result, dict(ran)


def test_the_solo_group_has_a_worker_of_its_own_and_the_others_share_the_rest(tmp_path):
    result, ran = run(tmp_path, "-n", "3", "--solo-group", "beside")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert len(ran) == 3 + 3 + 12, ran
    solo = {worker for name, worker in ran.items() if name.startswith("test_waits")}
    assert len(solo) == 1, ran  # the group on one worker
    others = {worker for name, worker in ran.items() if not name.startswith("test_waits")}
    assert solo.isdisjoint(others) and len(others) == 2, ran  # which took nothing else; the other two took the rest
    assert len({worker for name, worker in ran.items() if name.startswith("test_grouped")}) == 1, ran  # groups hold


def test_without_the_solo_group_in_the_run_its_worker_stops_and_the_others_run_everything(tmp_path):
    result, ran = run(tmp_path, "-n", "3", "--solo-group", "beside", "-k", "not waits")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert len(ran) == 3 + 12 and len(set(ran.values())) == 2, ran
