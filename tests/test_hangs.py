"""Hangs are found, explained and ended: the progress watchdog's rule, the stack summaries, and a frozen
rank in a real 2-node run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import processes_with, start_orch

from orchestrator.launch.backends import netns
from orchestrator.node.output import error_of
from orchestrator.node.stacks import RankStack, odd_ones, parse_faulthandler, parse_py_spy
from orchestrator.node.watchdog import Bounds, Watchdog, hang_tools

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- the rule


def _rec(step, phase="train", t=0.0):
    return {"step": step, "phase": phase, "t": t}


def test_before_the_first_step_the_long_bound_applies():
    dog = Watchdog(Bounds(floor=30, first=100), started=0.0)
    assert dog.observe({0: _rec(0, "load")}, 99.0) == ""
    assert "first step within 101 s (ORCH_STALL_FIRST=100)" in dog.observe({0: _rec(0, "load")}, 101.0)


def test_after_it_ten_median_steps_or_the_floor():
    dog = Watchdog(Bounds(floor=30, first=1000), started=0.0)
    for i in range(1, 11):  # one step every 5 s: 10 x median = 50 s > floor 30 s
        assert dog.observe({0: _rec(i), 1: _rec(i)}, 5.0 * i) == ""
    assert dog.bound() == 50.0
    assert dog.observe({0: _rec(10), 1: _rec(10)}, 99.0) == ""
    reason = dog.observe({0: _rec(10), 1: _rec(10)}, 101.0)
    assert "no rank progressed for 51 s after step 10 (bound 50 s: 10 x the median step time)" in reason
    fast = Watchdog(Bounds(floor=30, first=1000), started=0.0)
    for i in range(1, 11):
        fast.observe({0: _rec(i)}, 0.1 * i)
    assert fast.bound() == 30.0 and "ORCH_STALL_FLOOR=30" in fast.observe({0: _rec(10)}, 40.0)


def test_a_save_heartbeat_counts_for_the_busy_bound_only():
    dog = Watchdog(Bounds(floor=10, first=1000, busy=60), started=0.0)
    dog.observe({0: _rec(1), 1: _rec(1)}, 1.0)
    for now in range(3, 60, 2):  # rank 0 saves for a minute, beating every 2 s; rank 1 waits at the barrier
        assert dog.observe({0: _rec(1, "save", now), 1: _rec(1)}, float(now)) == "", now
    for now in range(61, 81, 2):  # still "saving" past the busy bound: a hang inside the save is found
        reason = dog.observe({0: _rec(1, "save", now), 1: _rec(1)}, float(now))
    assert "no rank progressed" in reason


def test_watchdog_off_and_knobs_parsed():
    assert Watchdog(Bounds(on=False), started=0.0).observe({}, 1e9) == ""
    assert Bounds.from_env({"ORCH_STALL_FLOOR": "12", "ORCH_WATCHDOG": "OFF"}) == Bounds(12.0, 1800.0, 3600.0, False)


def test_hang_tools_on_gpus_only_and_never_over_the_users():
    assert hang_tools({}, gpus=False, trace_prefix="/x/rank_") == {}
    tools = hang_tools({"TORCH_FR_BUFFER_SIZE": "50"}, gpus=True, trace_prefix="/x/rank_")
    assert "TORCH_FR_BUFFER_SIZE" not in tools
    assert tools["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and tools["TORCH_FR_DUMP_TEMP_FILE"] == "/x/rank_"


# ---------------------------------------------------------------- the stacks

PY_SPY = """Process 4242: python -m orchestrator.train dpo
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2810)
    wrapper (/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:81)
    training_step (/v/lib/python3.11/site-packages/transformers/trainer.py:4020)
Thread 4300 (idle): "orch-heartbeat"
    _heartbeat (/w/orchestrator/train/progress.py:80)
"""

FAULTHANDLER = """Thread 0x00007f (most recent call first):
  File "/w/orchestrator/train/progress.py", line 80 in _heartbeat

Current thread 0x00007e (most recent call first):
  File "/v/site-packages/torch/nn/functional.py", line 2100 in linear
  File "/v/site-packages/transformers/trainer.py", line 4020 in training_step
"""


def test_parsers_take_the_main_threads_innermost_frame():
    frames = parse_py_spy(PY_SPY)
    assert frames[0] == ("all_reduce", "torch/distributed/distributed_c10d.py:2810") and len(frames) == 3
    assert parse_faulthandler(FAULTHANDLER)[0] == ("linear", "torch/nn/functional.py:2100")


def _stack(rank, state="", where=("all_reduce", "torch/distributed/distributed_c10d.py:2810"), step=41):
    return RankStack(rank, 0, step, state, [where], "", "")


def test_the_rank_not_where_the_others_are():
    waiting = [_stack(r) for r in range(4)]
    assert odd_ones(waiting) == []
    assert [s.rank for s in odd_ones(waiting[:3] + [_stack(3, "stopped (SIGSTOP)")])] == [3]
    computing = _stack(2, where=("linear", "torch/nn/functional.py:2100"))
    assert [s.rank for s in odd_ones([waiting[0], waiting[1], computing, waiting[3]])] == [2]
    assert [s.rank for s in odd_ones([waiting[0], _stack(1, step=40)])] == [1]
    assert odd_ones([waiting[0], _stack(1, step=40)])[0].line() == (
        "rank 1: in all_reduce (torch/distributed/distributed_c10d.py:2810), step 40"
    )


# ---------------------------------------------------------------- a DataLoader worker that cannot send a batch

LOADER = """
import multiprocessing, sys, time
import torch
from torch.utils.data import DataLoader
from orchestrator.train import loader_workers
loader_workers.install()
# another queue of the rank: Python's behaviour, the traceback and the item dropped, the process goes on
queue = multiprocessing.Queue()
queue.put(lambda: 0)
queue.put("next")
print("OTHER QUEUE", queue.get(timeout=30), flush=True)

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):  # row 2 holds what pickle cannot send (a custom dataset or collator can)
        return {"x": torch.ones(2), "f": (lambda: i) if i == 2 else None}

for i, batch in enumerate(DataLoader(Rows(), batch_size=1, num_workers=1, collate_fn=lambda rows: rows)):
    print("BATCH", i, flush=True)
"""


def test_a_dataloader_worker_that_cannot_send_a_batch_hands_its_rank_the_error():
    """Python drops a batch its queue's feeder cannot pickle and the worker lives on, so the rank waited for that batch
    forever (until the first-step stall watchdog, 30 minutes): in a rank (train/loader_workers.py) the worker sends the
    error in the batch's place, as torch's workers send their exceptions, and the rank raises it at once, after the
    feeder's own error, which the node quotes first. The batches before it arrive whole: ending the worker instead raced
    with the rank fetching their tensors from it (a ConnectionResetError under load, seen in a make test-fast)."""
    done = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["OTHER QUEUE next", "BATCH 0", "BATCH 1"], done.stdout + done.stderr
    errors = [error_of(line) for line in done.stderr.splitlines() if error_of(line)]
    # the other queue's, then the worker's (the first error of a rank with no other queue failing), then the rank's
    assert "Can't pickle <function <lambda>" in errors[0], errors
    assert errors[1].startswith("AttributeError: Can't pickle local object 'Rows.__getitem__.<locals>"), errors
    assert errors[2] == "AttributeError: Caught AttributeError in DataLoader worker process 0.", done.stderr
    assert re.search(r"^\[orch\] DataLoader worker 0 \(pid \d+\) could not send a batch to its rank "
                     r"\(AttributeError\): sending the error in its place", done.stderr, re.M), done.stderr  # fmt: skip


# ---------------------------------------------------------------- a frozen rank in a real run

COMMAND = ["run", "phi3_dpo_fsdp", "--local", "--nodes", "2", "--smoke", "max_steps=400", "save_steps=1000"]
# Above 10 x the median step time on both nodes (~1 s a step here, ~2 s in a slow hour): each node's watchdog derives
# its bound from the steps it saw, and with 8 s node 1's came to 10 s and node 0's later, so node 1 ended the gang
# before node 0 named its rank (a fresh clone, 2026-11-29). With the floor both bounds are the same.
FLOOR = 20


def rank_pid(run: str, rank: int) -> int:
    (pid,) = processes_with(f"SKYPILOT_TASK_ID={run}", f"RANK={rank}", "LOCAL_RANK=0")
    return pid


@pytest.mark.e2e
def test_a_frozen_rank_is_named_and_the_gang_ends(project):
    proc, run = start_orch(
        project,
        [*COMMAND, "--env", f"ORCH_STALL_FLOOR={FLOOR}", "--env", "ORCH_MIN_BUS_GBPS=100000"],
        until="[orch] step 3/",
    )
    frozen = rank_pid(run, 1)
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out = proc.communicate(timeout=FLOOR + 90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(frozen, signal.SIGKILL)
        except ProcessLookupError:
            pass
    took = time.monotonic() - stopped_at
    assert proc.returncode != 0
    assert took < FLOOR + 60 + 15, took  # the bound, 60 s to end the gang, a poll and the stop's grace
    assert "(node1) [orch] node 1: rank 1: stopped (SIGSTOP) in " in out, out[-3000:]
    assert re.search(r"\(node0\) \[orch\] node 0: rank 0: in \S+ \(torch/distributed/", out), out[-3000:]
    final = out.strip().splitlines()[-1]
    assert final.startswith("[orch] failed after") and "stalled on node" in final, final
    assert "not where the others are: rank 1: stopped (SIGSTOP)" in out
    # the network check ran over the real group before the model loaded, and warned below its expectation
    assert "(node0) [orch] warning: network check: " in "".join(proc.seen)
    hang = next(project.glob(f"outputs/{run}/orch/hang"))
    assert "MainThread" in (hang / "node1-rank1.txt").read_text()
    assert json.loads((hang / "node0.json").read_text())[0]["rank"] == 0
    deadline = time.monotonic() + 30
    while processes_with(f"SKYPILOT_TASK_ID={run}"):
        assert time.monotonic() < deadline, "processes of the run outlived it"
        time.sleep(0.2)


# ---------------------------------------------------------------- nodes on a real (virtual) network


def orch_namespaces(owner: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [n for n in out.split() if n.startswith(f"orch-{owner}-")]


@pytest.mark.root  # network namespaces
def test_a_cut_link_is_found_named_and_every_rank_ends(project):
    proc, run = start_orch(project, [*COMMAND, "--netns", "--env", f"ORCH_STALL_FLOOR={FLOOR}"], until="[orch] step 3/")
    assert len(orch_namespaces(proc.pid)) == 2
    netns.Network(2, owner=proc.pid).cut(1)
    cut_at = time.monotonic()
    try:
        out = proc.communicate(timeout=FLOOR + 90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - cut_at
    assert proc.returncode != 0 and took < FLOOR + 60 + 15, (took, out[-3000:])
    assert re.search(r"\(node0\) \[orch\] node 0: node 1 \(10\.213\.\d+\.2\): unreachable", out), out[-3000:]
    assert re.search(r"\(node1\) \[orch\] node 1: node 0 \(10\.213\.\d+\.1\): unreachable", out), out[-3000:]
    final = out.strip().splitlines()[-1]
    assert final.startswith("[orch] failed after") and "stalled on node" in final and "unreachable" in final
    assert not processes_with(f"SKYPILOT_TASK_ID={run}")  # every rank of every node
    assert orch_namespaces(proc.pid) == []  # and the network is gone


@pytest.mark.root  # network namespaces
def test_a_node_that_never_joins_is_named_by_the_barrier(project, monkeypatch, capsys):
    from orchestrator import cli

    entered = netns.Network.__enter__

    def then_cut(self):
        entered(self)
        self.cut(1)  # node 1's link is down from the start: it never reaches the head
        return self

    monkeypatch.setattr(netns.Network, "__enter__", then_cut)
    monkeypatch.chdir(project)
    started = time.monotonic()
    code = cli.main([*COMMAND, "--netns", "--env", "ORCH_RENDEZVOUS_TIMEOUT=10"])
    out = capsys.readouterr().out
    assert code != 0 and time.monotonic() - started < 60
    assert "node(s) 1 never joined the head within 10 s" in out, out[-2000:]
    final = out.strip().splitlines()[-1]
    assert final.startswith("[orch] failed after") and "never joined" in final, final
    assert orch_namespaces(os.getpid()) == []


@pytest.mark.root  # network namespaces
def test_leftovers_of_a_killed_owner_are_swept(tmp_path):
    """Made while its owner lives (another test's `--netns` run sweeps at its start, and took a network made for an
    owner already gone while it was being made), left when the owner is killed with SIGKILL; the next sweep, this
    test's or a concurrent run's, removes its namespaces, their /etc/netns files and its bridge."""
    owner = subprocess.Popen(["sleep", "600"])
    try:
        net = netns.Network(2, owner=owner.pid).__enter__()  # never exited, as when orch is killed
        assert len(orch_namespaces(owner.pid)) == 2
    finally:
        owner.kill()
        owner.wait()  # its pid no longer exists
    netns.sweep()
    assert orch_namespaces(owner.pid) == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not re.search(rf"^\d+: {net.bridge}[:@]", links, re.M), links
    assert not Path(f"/etc/netns/{net.namespaces[0]}").exists()


def test_netns_needs_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.available() == "--netns needs root (it creates network namespaces); run as root or drop --netns"


# ---------------------------------------------------------------- the network check


def test_bus_bandwidth_and_what_is_expected():
    from orchestrator.train import netcheck

    assert netcheck.bus_gbps(64 * 2**20, 0.01, 16) == pytest.approx(64 * 2**20 * 2 * 15 / 16 / 0.01 / 1e9)
    assert netcheck.expectation({}, gpus=True, nodes=2) == netcheck.MULTI_NODE_GPU_GBPS
    assert netcheck.expectation({}, gpus=True, nodes=1) is None and netcheck.expectation({}, False, 4) is None
    assert netcheck.expectation({"ORCH_MIN_BUS_GBPS": "2.5"}, gpus=False, nodes=2) == 2.5


@pytest.mark.parametrize("mode", ["warn", "error", "off"])
def test_a_network_below_expectation_warns_or_stops(monkeypatch, capsys, mode):
    """The check's decision on a (single-process, gloo) group whose all-reduces are timed as slow: a warning with
    the usual causes, or with ORCH_NETCHECK=error one `orch: error:` line and exit 2 before the model loads."""
    import torch
    import torch.distributed as dist

    from orchestrator.train import netcheck

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: None)
    args = type("Args", (), {"device": torch.device("cpu")})()
    env = {"ORCH_NETCHECK": mode, "ORCH_MIN_BUS_GBPS": "100000", "LOCAL_WORLD_SIZE": "1"}  # no bus gives 100 TB/s
    if mode == "error":
        with pytest.raises(SystemExit) as stop:
            netcheck.run(args, env)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("orch: error: network check: ") and "usual causes" in err[0]
        return
    gbps = netcheck.run(args, env)
    out = capsys.readouterr().out
    if mode == "off":
        assert gbps is None and out == ""
        return
    assert "[orch] network check: all-reduce of 4 MiB over 2 ranks on 2 node(s) (gloo):" in out
    assert "[orch] warning: network check:" in out and "(expected >= 100000 GB/s)" in out


def test_retryable_failures_are_the_clusters():
    from orchestrator.core.errors import retryable

    for error in (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1",
        "torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    ):
        assert retryable(error), error
    for error in ("torch.OutOfMemoryError: CUDA out of memory.", "KeyError: 'messages'", ""):
        assert not retryable(error), error


def test_a_save_heartbeat_cannot_hide_a_dead_network():
    """Rank 0 saves, beating every 2 s, well within the busy bound; node 1 stops answering at 10 s: after PEER_LOST
    seconds more the node stalls, naming the unreachable node, instead of crediting the heartbeat for an hour."""
    from orchestrator.node.watchdog import PEER_LOST

    dog = Watchdog(Bounds(floor=10, first=1000, busy=3600), started=0.0)
    dog.observe({0: _rec(1)}, 1.0)
    reason = ""
    for now in range(3, 200, 2):
        dog.peers(["node 1 (10.0.0.2): unreachable"] if now >= 10 else [], float(now))
        reason = dog.observe({0: _rec(1, "save", now)}, float(now))
        if reason:
            break
    assert 10 + PEER_LOST < now <= 10 + PEER_LOST + 4, now
    assert reason.startswith("rank 0 has been in save for ") and "node 1 (10.0.0.2): unreachable for 6" in reason
    healthy = Watchdog(Bounds(floor=10, first=1000, busy=3600), started=0.0)
    healthy.observe({0: _rec(1)}, 1.0)
    for now in range(3, 300, 2):  # the same save with every node reachable: the heartbeat counts
        healthy.peers([], float(now))
        assert healthy.observe({0: _rec(1, "save", now)}, float(now)) == ""
