"""Name the slow node while it is slow (issue 32, item 2): an emulated node throttled mid-run to 0.1 core with a cgroup
v1 CPU quota (cpu.cfs_quota_us) is named within 3 logging steps; the same run unthrottled names nobody.

Both emulated nodes share this 2-core host with whatever the suite's other worker runs. A neighbour that lands on the
core of one node and not the other is a real noisy neighbour for that node, and the detector rightly names it: CI saw
node 0 at 2.0x for 3 logging steps (steps 12-14) with nothing throttled. So, once the first logging steps (not judged)
are logged, both runs put every thread of both nodes on one core (`share_one_core`): the suite's load then falls on
both nodes alike, as a healthy cluster's nodes see the same conditions, and the only difference left between the two
runs is the quota."""

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_faults import processes_with

from orchestrator.train import stragglers

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
COMMAND = ["run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--env", "GLOBAL_BATCH_SIZE=256",
           "max_steps=16", "save_steps=100", "per_device_train_batch_size=4"]


ONE_CORE = min(os.sched_getaffinity(0))


def share_one_core(marker: str) -> None:
    """Every thread of this run's processes (both nodes) onto one core; threads started later inherit it."""
    for pid in processes_with(f"ORCH_TEST_RUN={marker}"):
        try:
            threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue  # gone meanwhile
        for tid in threads:
            try:
                os.sched_setaffinity(tid, {ONE_CORE})
            except OSError:
                pass  # gone meanwhile


def run_and_maybe_throttle(project, throttle: bool, *extra: str) -> tuple[str, int]:
    """Run COMMAND; once step 2 is logged, put both nodes on one core (see the module's docstring); with `throttle`,
    once step 4 is logged, move node 1's processes into a cgroup of 0.1 core. Returns the output and the last step
    logged before the quota took effect (0 when not throttled)."""
    marker = uuid.uuid4().hex[:8]
    env = {**os.environ, "ORCH_TEST_RUN": marker}
    group = CPU_CGROUP / f"orch-test-{marker}"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *COMMAND, *extra], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, throttled_after, shared = [], 0, False
    try:
        for line in proc.stdout:
            lines.append(line)
            step = re.match(r"\(node0\) \[orch\] step (\d+)/", line)
            if step and not shared and int(step.group(1)) >= stragglers.WARMUP:
                share_one_core(marker)
                shared = True
            if throttle and step and not throttled_after and int(step.group(1)) >= 4:
                group.mkdir()
                # 0.1 of a core (the issue asks <= 0.3; on the core both nodes share, 0.2 left node 1 at 1.75-3.5x
                # node 0 with the suite's load beside it, 0.1 leaves it further from the 1.5x that names it), in
                # 10 ms periods: a step spans many (in 100 ms periods a short step runs whole inside one burst, or
                # stalls 90 ms: no steady 0.1)
                (group / "cpu.cfs_period_us").write_text("10000")
                (group / "cpu.cfs_quota_us").write_text("1000")
                pids = processes_with("SKYPILOT_NODE_RANK=1", f"ORCH_TEST_RUN={marker}")  # node 1 of this run
                assert pids, "node 1's processes not found"
                for pid in pids:
                    try:
                        (group / "cgroup.procs").write_text(str(pid))
                    except OSError:
                        pass  # gone meanwhile
                throttled_after = int(step.group(1))
        assert proc.wait(timeout=600) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if group.exists():
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (CPU_CGROUP / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            deadline = time.monotonic() + 10
            while group.exists() and time.monotonic() < deadline:
                try:
                    group.rmdir()
                except OSError:
                    time.sleep(0.2)
    return "".join(lines), throttled_after


@pytest.mark.e2e
@pytest.mark.skipif(not (CPU_CGROUP / "cpu.cfs_quota_us").exists(), reason="needs cgroup v1's cpu controller")
@pytest.mark.root  # a cpu cgroup of its own
def test_a_throttled_node_is_named_within_three_logging_steps(project):
    out, after = run_and_maybe_throttle(project, True, "max_steps=10")  # named by step 8: the rest would crawl at 0.1
    named = re.search(r"^\(node0\) \[orch\] straggler at step (\d+): node 1 \(rank 1\) takes ([\d.]+)x the others' "
                      r"compute per step for 3 logging steps; the others wait for it in collectives; the usual causes",
                      out, re.M)  # fmt: skip
    assert named, out[-4000:]
    assert int(named.group(1)) <= after + 3 + 1, (after, named.group(0))  # + the step in flight when throttled
    assert float(named.group(2)) >= 1.5
    assert "straggler" not in out.split(f"step {after}/")[0]  # nobody before the throttle
    assert re.search(r"^\[orch\] slowest at the end: rank 1 on node 1, [\d.]+x the others' compute per step", out, re.M)
    assert "[orch] stragglers named during the run: 1; first: straggler at step" in out


@pytest.mark.e2e
def test_the_same_run_unthrottled_names_nobody_and_says_its_scaling_efficiency(project):
    """After a single-node run of the same settings (which records its rate per rank in CHECKPOINT_ROOT), the 2-node
    run also says its efficiency against it (core/scaling.py)."""
    single = [*COMMAND, "max_steps=6"]  # the schedule is not part of the rate's key
    single[single.index("--nodes") + 1] = "1"
    # on the core the 2-node run shares (share_one_core), from its start: its processes see one CPU, so its rank runs
    # one OpenMP thread. Unpinned beside the suite's 2-node runs, its 2 threads took ~20 s a step instead of 0.3 (spin
    # waits on an oversubscribed host): a rate of 225 tok/s, and a 2-node run at 1,600% of it
    first = subprocess.run([sys.executable, "-m", "orchestrator", *single], cwd=project, capture_output=True, text=True,
                           timeout=600, preexec_fn=lambda: os.sched_setaffinity(0, {ONE_CORE}))  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:]
    rates = json.loads((project / "outputs" / "orch_rates.json").read_text())
    ((key, recorded),) = rates.items()
    assert key.endswith("|4|1|CPU") and recorded["shape"] == {"nodes": 1, "per_node": 1, "world": 1}
    assert "scaling efficiency" not in first.stdout  # one node: recorded, nothing to compare

    out, _ = run_and_maybe_throttle(project, False, "--fresh")  # the same run at another shape: start over
    assert "straggler at step" not in out, out[-4000:]
    assert "[orch] stragglers named during the run: 0" in out
    assert re.search(r"^\[orch\] slowest at the end: rank \d on node \d, [\d.]+x the others'", out, re.M)
    said = re.search(r"^\(node0\) \[orch\] scaling efficiency: (\d+)% of the single-node rate per rank \(([\d,]+) "
                     r"tok/s per rank on 2 x 1; ([\d,]+) on 1 x 1 by run ", out, re.M)  # fmt: skip
    assert said, out[-3000:]
    assert round(float(said.group(3).replace(",", ""))) == round(recorded["per_rank_tokens_per_s"])
    assert 0 < int(said.group(1)) < 1000
    assert f"\n{said.group(0)[8:]}" in out  # the summary repeats it


@pytest.mark.unit
def test_a_node_is_named_after_three_slow_logging_steps_and_only_then():
    watch = stragglers.Watch()
    watch.seen = stragglers.WARMUP  # past the first logging steps, which are shown but not judged
    fast = [(1.0, 2.0, 0), (1.0, 2.0, 0), (1.1, 2.0, 1), (0.9, 2.0, 1)]
    slow = [(1.0, 2.0, 0), (1.0, 2.0, 0), (3.0, 0.1, 1), (3.2, 0.1, 1)]  # both ranks of node 1 three times slower
    assert watch.see(fast, 1)[1] == []
    assert watch.see(slow, 2)[1] == [] and watch.see(slow, 3)[1] == []
    figures, (line,) = watch.see(slow, 4)
    assert line.startswith("[orch] straggler at step 4: node 1 (ranks 2-3) takes 3.1x the others' compute per step")
    assert figures["slowest_rank"] == 3 and figures["slowest_node"] == 1
    assert watch.see(slow, 5)[1] == []  # named once per episode
    assert watch.see(fast, 6)[1] == [] and watch.report()["named"] == [line]
    # one slow rank among healthy ones on its node: the rank, not the node
    one = [(1.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 1.0, 1), (1.0, 1.0, 1), (2.0, 0.0, 1)]
    for step in (7, 8):
        assert watch.see(one, step)[1] == []
    assert watch.see(one, 9)[1][0].startswith("[orch] straggler at step 9: rank 5 on node 1 takes 2.0x")
