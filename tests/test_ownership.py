"""orch owns its processes: however orch ends, nothing of a local run outlives it by 30 s, the record says
how the run ended, and one run directory has one owner."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import orch
from test_faults import processes_with, start_orch

pytestmark = pytest.mark.cli

COMMAND = ["run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke", "max_steps=400", "save_steps=1000"]


def start(project: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """orch running a 2-node smoke run, once its ranks train; returns it and its run id."""
    proc, run = start_orch(project, [*COMMAND, *extra], until="[orch] step ")
    assert proc.poll() is None, "the run did not start training"
    return proc, run


def record_state(project: Path, run: str) -> str:
    text = (project / "sky_jobs" / f"{run}.yaml").read_text()
    return re.search(r"^# state: (.*)$", text, re.M).group(1)


def wait_gone(run: str, since: float) -> float:
    while processes_with(f"SKYPILOT_TASK_ID={run}"):
        assert time.monotonic() - since < 30, f"processes of {run} outlived orch by 30 s"
        time.sleep(0.2)
    return time.monotonic() - since


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL])  # SIGTERM: `orch cancel` below sends it; SIGHUP takes its path
def test_ending_orch_ends_every_process_of_the_run(project, sig):
    proc, run = start(project)
    assert len(processes_with(f"SKYPILOT_TASK_ID={run}")) >= 4  # 2 guards, 2 bash, launchers, 2 ranks
    killed = time.monotonic()
    proc.send_signal(sig)
    proc.stdout.read()
    proc.wait(timeout=60)
    wait_gone(run, killed)
    status = orch("status", cwd=project)
    assert status.returncode == 0, status.stderr
    line = next(x for x in status.stdout.splitlines() if x.startswith(run))
    if sig == signal.SIGKILL:  # orch could not record it: `orch status` finds the run without an owner
        assert "interrupted (orch pid" in line and "ended without recording it" in line
    else:
        assert f"interrupted ({sig.name})" in line and record_state(project, run) == f"interrupted ({sig.name})"
    assert record_state(project, run).startswith("interrupted")


@pytest.mark.e2e
def test_a_second_launch_of_a_live_run_is_refused_and_cancel_stops_it(project):
    first, run = start(project)
    second = orch(*COMMAND, cwd=project, timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and f"run {run} is already running (orch pid {first.pid}" in err[0]
    assert f"kill {first.pid}" in err[0]
    assert second.stdout.count("[orch] step") == 0
    # `orch logs RUN --follow` from another terminal streams the live run's log until it ends, and says how it ended
    follower = subprocess.Popen([sys.executable, "-m", "orchestrator", "logs", run, "--follow"], cwd=project,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    stopped = time.monotonic()
    cancel = orch("cancel", run, cwd=project, timeout=60)
    assert cancel.returncode == 0, cancel.stderr
    first.stdout.read()
    assert first.wait(timeout=30) == 128 + signal.SIGTERM
    wait_gone(run, stopped)
    assert record_state(project, run) == "interrupted (SIGTERM)"
    followed = follower.communicate(timeout=30)[0]
    assert follower.returncode == 1, followed[-3000:]
    assert "(node0) [orch] step " in followed and followed.rstrip().splitlines()[-1] == (
        f"[orch] run {run}: interrupted (SIGTERM)")  # fmt: skip
    status = orch("status", cwd=project)
    assert "interrupted (SIGTERM)" in next(x for x in status.stdout.splitlines() if x.startswith(run))


def test_guard_ends_a_tree_that_left_its_session(tmp_path):
    """What torchrun does to its ranks (a session of their own) does not hide them from the guard."""
    marker = f"ORCH_GUARD_TEST={os.getpid()}"
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
        "time.sleep(300)"
    )
    watch, alive = os.pipe()
    guard = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.launch.backends.guard", str(watch), "--", sys.executable, "-c", script],
        env={**os.environ, "ORCH_GUARD_TEST": str(os.getpid()), "ORCH_STOP_GRACE": "2"},
        pass_fds=(watch,),
        start_new_session=True,
    )
    os.close(watch)
    deadline = time.monotonic() + 20
    while len(processes_with(marker)) < 3:
        assert time.monotonic() < deadline, "the guard's tree did not start"
        time.sleep(0.1)
    os.close(alive)  # as when orch is killed: the guard reads EOF
    closed = time.monotonic()
    assert guard.wait(timeout=20) in (128 + signal.SIGHUP, 128 + signal.SIGTERM)
    while processes_with(marker):
        assert time.monotonic() - closed < 15, "a process that left the guard's session survived"
        time.sleep(0.1)
