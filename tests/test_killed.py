"""A rank a signal ended (node/killed.py): torchrun's report read as torch writes it, the kernel's OOM count, the line
the node says; and a real OOM kill in a 2-node run, named instead of the network error the other node saw."""

import json
import re

import pytest
from conftest import ROOT, orch

from orchestrator.node.killed import Killed, RootCause, cause, oom_kills

pytestmark = pytest.mark.unit


def _report(failures: dict) -> list[str]:
    """The lines torchrun's launcher prints for these failures: torch's own ChildFailedError, as Python shows it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    error = ChildFailedError("orchestrator.train", failures)
    return f"{type(error).__module__}.{type(error).__name__}: {error}".splitlines()


def _fed(lines: list[str]) -> Killed | None:
    found = RootCause()
    for line in lines:
        found.feed(line + "\n")
    return found.killed


def test_torchruns_report_names_the_rank_a_signal_ended(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    none = str(tmp_path / "none.json")
    assert _fed(_report({1: ProcessFailure(0, 4242, -9, none)})) == Killed(1, 9, "SIGKILL", 4242)
    assert _fed(_report({3: ProcessFailure(1, 77, -11, none)})) == Killed(3, 11, "SIGSEGV", 77)
    # a rank that raised is the root cause: the ranks torchrun then ended with SIGTERM are not
    raised = tmp_path / "error.json"
    raised.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\nRuntimeError: boom", "timestamp": "1"}}}))  # fmt: skip
    lines = _report({0: ProcessFailure(0, 98, -15, none), 1: ProcessFailure(1, 99, 1, str(raised))})
    assert any("Signal 15 (SIGTERM) received by PID 98" in line for line in lines)  # listed among the others
    assert _fed(lines) is None
    assert _fed(["  traceback : Signal 9 (SIGKILL) received by PID 5"]) is None  # only in the root cause's block


def test_the_kernels_oom_count(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 3\npgfault 9\n")
    assert oom_kills(vmstat) == 3
    vmstat.write_text("nr_free_pages 1\n")  # before Linux 4.13
    assert oom_kills(vmstat) is None and oom_kills(tmp_path / "absent") is None
    assert isinstance(oom_kills(), int)  # this machine's kernel counts them


def test_the_line_says_why_when_the_kernel_says():
    sigkill = Killed(1, 9, "SIGKILL", 4242)
    oom = cause(sigkill, 1, 3, 5, 6)
    assert oom.startswith("rank 1 (node 1) was killed by SIGKILL (signal 9) after step 3: the kernel's OOM killer (1 ")
    assert "host memory (RAM, not GPU memory) ran out" in oom
    assert cause(sigkill, 1, None, 5, 5) == ("rank 1 (node 1) was killed by SIGKILL (signal 9), not by the kernel's "
                                             "OOM killer (none on this machine during the launch): from outside the "
                                             "training")  # fmt: skip
    assert "this kernel does not count them" in cause(sigkill, 0, 2, None, None)
    assert "(signal 9) before its first step, not by " in cause(sigkill, 0, 0, 1, 1)
    assert "a crash in native code" in cause(Killed(2, 11, "SIGSEGV", 1), 0, 2, 0, 0)
    sigterm = cause(Killed(2, 15, "SIGTERM", 1), 0, 2, 0, 0)
    assert sigterm.endswith("SIGTERM (signal 15) after step 2: sent from outside the training")


def test_the_other_nodes_find_it_where_they_look_for_a_rank_that_left_early(tmp_path):
    """On a cluster the other nodes are not stopped by a local backend: they see the connection close, which alone
    reads as a retryable network failure, and look for an early-exit record first (node/supervise._left_early)."""
    import time

    from orchestrator.core.home import record_early_exit
    from orchestrator.node.supervise import _left_early

    line = cause(Killed(1, 9, "SIGKILL", 4242), 1, 3, 0, 1)
    record_early_exit(str(tmp_path), 1, 1, line)
    assert json.loads((tmp_path / "orch" / "early-exit" / "rank1.json").read_text())["node"] == 1
    assert _left_early(str(tmp_path), since=time.time() - 60) == line


def test_the_local_run_names_the_node_whose_rank_left_not_the_first_node_to_exit(tmp_path):
    """The node that sees the connection close finds the record and exits at once, often before the record's own
    node has said so (CI once ended a run with node 0's gloo error this way): the local run's last line follows the
    record to its node. A record of an earlier attempt, or of the node that failed first, changes nothing."""
    import time

    from orchestrator.core.home import early_exits, record_early_exit
    from orchestrator.launch.backends.local import LocalResult, _root_cause

    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:24980"
    first = LocalResult(1, 0, error=gloo, codes=(1, -15))
    since = time.time()
    assert _root_cause(first, tmp_path, since) == first  # no record
    line = cause(Killed(1, 9, "SIGKILL", 4242), 1, 3, 0, 1)
    record_early_exit(str(tmp_path), 1, 1, line)
    named = _root_cause(first, tmp_path, since)
    assert (named.failed_node, named.returncode, named.error) == (1, 1, f"orch: error: {line}")  # stopped: its 1
    assert _root_cause(LocalResult(1, 0, error=gloo, codes=(1, 1)), tmp_path, time.time() + 60).failed_node == 0
    assert _root_cause(LocalResult(1, 1, error="x", codes=(143, 1)), tmp_path, since).error == "x"
    own = LocalResult(1, 0, error="orchestrator.train.divergence.Diverged: loss is nan at step 3", codes=(1, 1))
    assert _root_cause(own, tmp_path, since) == own  # its own failure (all ranks diverge at once): not followed
    (early_exits(tmp_path) / "rank1.json").write_text("[1, 2]")  # not a record: ignored, not a traceback
    (early_exits(tmp_path) / "rank2.json").write_text(json.dumps({"node": 7, "error": "e", "time": time.time()}))
    assert _root_cause(first, tmp_path, since) == first  # a node this run does not have


@pytest.mark.cli  # three runs of two bash nodes under their guards
def test_the_local_run_quotes_the_failing_nodes_verdict_not_its_first_error_line(tmp_path):
    """A node's last line says what its supervisor made of its ranks' errors (node/output.verdict): a node that stopped
    asking to be retried quotes why, after the network error its ranks printed first; a kill's cause is quoted bare
    in it. The local run quotes the verdict, as a cloud run does (launch/job_end.py); without one, the first error."""
    import io
    import shlex

    from orchestrator.launch.backends.local import run_nodes
    from orchestrator.node.output import verdict

    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:24980"
    gave_up = f"orch: error: node 1 failed the retryable way 3 times in a row without training a step at all: {gloo}"
    killed = cause(Killed(1, 9, "SIGKILL", 4242), 1, 3, 0, 1)
    for said, quoted in ((gave_up, gave_up), (killed, f"orch: error: {killed}"), ("", gloo)):
        last = shlex.quote(verdict(1, 1, said))
        script = f'if [ "$NODE" = 1 ]; then echo {shlex.quote(gloo)}; echo {last}; exit 1; fi; sleep 30'
        envs = [{"NODE": "0", "ORCH_STOP_GRACE": "2"}, {"NODE": "1", "ORCH_STOP_GRACE": "2"}]
        result = run_nodes(script, envs, tmp_path, sink=io.StringIO())
        assert (result.failed_node, result.error) == (1, quoted)


STAND_IN = """
import sys
print(sys.argv[1] if len(sys.argv) > 1 else open({report!r}).read(), flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("first, signal, said, code", [
    ("RuntimeError: Connection closed by peer [10.0.0.2]:29500", -9, "was killed by SIGKILL (signal 9)", 1),
    ("", -11, "was killed by SIGSEGV (signal 11): a crash in native code", 1),
    ("RuntimeError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE)",
     -6, "a network or GPU failure", 75),
])  # fmt: skip
def test_the_node_names_the_rank_a_signal_ended_unless_a_network_failure_came_first(tmp_path, first, signal, said,
                                                                                     code):  # fmt: skip
    """node/supervise.py over a stand-in for accelerate that prints an error a rank saw and torchrun's report (torch's
    own text): SIGKILL (the OOM killer, a person) is the cause whatever the others saw; an abort after NCCL's watchdog
    timed a collective out stays the retryable network failure it was."""
    from conftest import supervised
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    report = tmp_path / "report.txt"
    report.write_text("\n".join([first, *_report({1: ProcessFailure(0, 4242, signal, str(tmp_path / "none"))})]))
    done = supervised(STAND_IN.format(report=str(report)), tmp_path / "home")
    assert done.returncode == code, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("[orch] failed on node 0: ") and said in last, done.stdout[-2000:]


FAULT = ROOT / "tests" / "fixtures" / "rank_fault"


def _fixture():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rank_fault", FAULT / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # in this process (no RANK): its names only
    return module


@pytest.mark.root  # a memory cgroup of its own
def test_a_rank_the_oom_killer_ends_is_named_not_the_network_error_it_caused(project):
    """Rank 1 of a 2-node smoke run is killed by the kernel's OOM killer at step 3, for real (tests/fixtures/
    rank_fault: a memory cgroup of its own with a limit, then allocations). Before, the run's last line quoted no
    error ("node 1 exited with code 1 (its log lines are prefixed (node1))"); now it names rank 1 and the OOM killer,
    and the run is not retryable."""
    fault = _fixture()
    groups = f"{fault.CGROUP_PREFIX}*"
    before = set(fault.memory_cgroup().glob(groups))
    try:
        done = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--env", f"PYTHONPATH={FAULT}",
                    "--env", "TEST_RANK_FAULT=oom", cwd=project, timeout=300)  # fmt: skip
    finally:
        for group in set(fault.memory_cgroup().glob(groups)) - before:
            group.rmdir()
    assert done.returncode == 1, done.stdout[-3000:]
    final = done.stdout.strip().splitlines()[-1]
    assert re.search(r"^\[orch\] failed after [\d.]+ s: node 1 exited with code 1: orch: error: rank 1 \(node 1\) "
                     r"was killed by SIGKILL \(signal 9\) after step \d: the kernel's OOM killer \(\d+ OOM "
                     r"kill\(s\) on this machine during the launch\): host memory \(RAM, not GPU memory\) ran out",
                     final), final  # fmt: skip
    assert "retryable" not in done.stdout and "orch exits 75" not in done.stdout
    assert "(node1) [orch] failed on node 1: accelerate exited with code 1: rank 1 (node 1) was killed" in done.stdout
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", done.stdout, re.M).group(1)
    record = json.loads((output_dir / "orch" / "early-exit" / "rank1.json").read_text())  # what the last line follows
    assert record["node"] == 1 and record["error"] in final
    assert re.search(r"^\[orch\] last \d+ lines of node 1:$", done.stdout, re.M), done.stdout[-3000:]  # the same node's


@pytest.mark.unit
def test_a_node_that_fails_the_retryable_way_again_and_again_without_progress_gives_up(tmp_path):
    """SkyPilot 0.14 recovers a managed job on exit 75 without counting it against max_restarts_on_errors
    (sky/jobs/recovery_strategy.py): a node's 75 for a failure that comes back every time (an NCCL setting wrong for
    the cluster, a hang at the same step) would relaunch without end. node/retries.py: after ORCH_STUCK_RETRIES (3)
    retryable exits in a row with no step beyond the best before, the node exits 1 and says why."""
    from orchestrator.node import retries

    def run(steps, env=None, node=0, out=None):
        out = out or tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        return [retries.give_up(str(out), node, step, env or {}, now=1000.0 + i) for i, step in enumerate(steps)], out

    said, out = run([None, None, None])  # NCCL's initialisation fails every time: no step at all
    assert said[:2] == ["", ""] and said[2].startswith("node 0 failed the retryable way 3 times in a row without "
                                                       "training a step at all: not retried again")  # fmt: skip
    said, _ = run([5, 5, 5, 5])  # a hang the watchdog ends at the same step every time
    assert said[:3] == ["", "", ""] and "without training a step beyond step 5" in said[3]
    said, _ = run([5, 5, 9, 9, 9, 14])  # progress in between: each is a new start
    assert not any(said)
    said, out = run([5, 5], env={"ORCH_STUCK_RETRIES": "1"})
    assert said[0] == "" and "ORCH_STUCK_RETRIES=1 allows more" in said[1]
    other, _ = run([5, 5], node=1, out=out)  # each node counts its own
    assert other == ["", ""]
    assert retries.give_up("", 0, None, {}) == ""  # nowhere to count: the 75 stands
    # one launch's exits count together: a managed job's recoveries keep SKYPILOT_TASK_ID; a launch by hand (a new
    # task id, or a local rerun's new ORCH_RUN_TOKEN) starts its own count, and the first launch's goes on
    managed = {"SKYPILOT_TASK_ID": "sky-managed-2026-12-06_run_7", "ORCH_STUCK_RETRIES": "2"}
    by_hand = {**managed, "SKYPILOT_TASK_ID": "sky-2026-12-06-04-50_orch-x_3"}
    out = tmp_path / "launches"
    said = [retries.give_up(str(out), 0, None, env, now=2000.0 + i)
            for i, env in enumerate((managed, managed, by_hand, by_hand, managed, {**by_hand, "ORCH_RUN_TOKEN": "t"}))]
    assert [bool(s) for s in said] == [False, True, False, True, True, False], said
    # where a rank failed before reporting its output dir, the node reads it from the ranks' argv (node/script.py)
    from orchestrator.node.script import output_dir_in

    assert output_dir_in(["accelerate", "launch", "--output_dir", "/ckpt/run"]) == "/ckpt/run"
    assert output_dir_in(["--output_dir", "/theirs", "--output_dir", "/ckpt/run"]) == "/ckpt/run"  # the last wins
    assert output_dir_in(["accelerate", "launch", "--output_dir"]) == ""


RETRYABLE_STAND_IN = """
print("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error",
      flush=True)
raise SystemExit(1)
"""


@pytest.mark.e2e  # three node launchers over a stand-in rank, ~3 s: make test, not the inner loop
def test_the_node_exits_75_for_a_network_failure_until_it_keeps_coming_back(tmp_path):
    """node/supervise.py over a stand-in rank that fails with NCCL's network error before any progress report: 75
    twice, then exit 1 with a verdict that says why (what `orch run` and `orch logs` quote), its --output_dir read
    from the launch's argv."""
    from conftest import supervised

    out = tmp_path / "ckpt" / "run"
    codes, lasts = [], []
    for _ in range(3):
        done = supervised(RETRYABLE_STAND_IN, tmp_path / "home", args=("--output_dir", str(out)))
        codes.append(done.returncode)
        lasts.append(done.stdout.strip().splitlines()[-1])
    assert codes == [75, 75, 1], lasts
    assert "orch exits 75, retryable" in lasts[0]
    assert lasts[2].startswith("[orch] failed on node 0: accelerate exited with code 1: orch: error: node 0 failed the "
                               "retryable way 3 times in a row without training a step at all: not retried again")
    assert lasts[2].endswith("remote process exited or there was a network error")
    assert len(list((out / "orch" / "retryable").glob("node0-*.json"))) == 3


STALLING_STAND_IN = """
import json, os, sys, time
record = {{"rank": 0, "pid": os.getpid(), "step": 0, "phase": "load", "t": time.time(), "output_dir": {out!r}}}
open(os.path.join(os.environ["ORCH_PROGRESS_DIR"], "rank0.json"), "w").write(json.dumps(record))
time.sleep(120)
"""


@pytest.mark.e2e  # two stalls the watchdog waits out, ~4.5 s: make test, not the inner loop
def test_a_stall_the_watchdog_ends_counts_as_a_retryable_exit(tmp_path):
    """The watchdog's stall (exit 75) goes through node/retries.py too: with ORCH_STUCK_RETRIES=1 the second stall at
    the same step exits 1, its verdict quoting the stall."""
    from conftest import supervised

    out = tmp_path / "run"
    env = {"ORCH_WATCHDOG": "on", "ORCH_STALL_FIRST": "2", "ORCH_STUCK_RETRIES": "1"}
    first = supervised(STALLING_STAND_IN.format(out=str(out)), tmp_path / "home", env=env)
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-2000:]
    second = supervised(STALLING_STAND_IN.format(out=str(out)), tmp_path / "home", env=env)
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    last = second.stdout.strip().splitlines()[-1]
    assert re.match(r"\[orch\] failed on node 0: accelerate exited with code \d+: orch: error: node 0 failed the "
                    r"retryable way once without training a step beyond step 0: not retried again .*: "
                    r"stalled on node 0", last), last  # fmt: skip


@pytest.mark.unit
def test_a_traceback_s_last_line_is_quoted_whatever_its_class_is_called():
    """Python prints an exception of another package with its module, and not every class name ends in Error: the
    node and the local run quoted nothing for huggingface_hub's OfflineModeIsEnabled (push_to_hub offline), pyarrow's
    ArrowInvalid (a JSON file datasets cannot parse), a network timeout or Triton's OutOfResources; log lines that
    name a module are not errors."""
    from orchestrator.node.output import error_of

    for line in [
        "[rank0]: huggingface_hub.errors.OfflineModeIsEnabled: Cannot reach https://huggingface.co/api/repos/create",
        "pyarrow.lib.ArrowInvalid: JSON parse error: Column(/chosen) changed from string to array in row 1",
        "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out.",
        "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 131072, Hardware limit: 1013",
        "KeyboardInterrupt: stopped",
        "[rank1]: ValueError: text input must be of type `str`",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        # argparse's own line (TRL's parser on a rank: plain `sky launch` with a bad TRL_OVERRIDES); the line after
        # it, `CalledProcessError: Command [...] returned non-zero exit status 2`, was quoted instead
        "__main__.py: error: argument --optim: invalid choice: 'adamw' (choose from 'adamw_torch', 'sgd')",
    ]:
        assert error_of(line) == line.removeprefix("[rank0]: ").removeprefix("[rank1]: "), line
    for line in [
        "torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 12 closing signal SIGTERM",
        "[2026-12-06 07:14:47,752] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "E1206 07:31:36.952000 31203 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)",
        "  File \"/work/main/orchestrator/train/entry.py\", line 118, in build",
        "e.g. Foo: not a class",
        "a note: error: in words, not a program's",
        "/x/trl/trainer/dpo_trainer.py:12: UserWarning: a warning, printed",
    ]:
        assert error_of(line) == "", line
