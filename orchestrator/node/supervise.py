"""`orch node` keeps its `accelerate launch` as a child instead of exec-ing it: it relays the output, watches the
ranks' progress (node/watchdog.py) and, on a stall, dumps every rank's stack (node/stacks.py), names the rank that is
not where the others are and any node it cannot reach, and ends the node's processes with EXIT_STALLED. A failure
ends with one line quoting the first real error of the node, not the launcher's summary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import credentials, memory_fix
from orchestrator.core.errors import retryable
from orchestrator.core.home import (
    SOCKET_TMPDIR,
    first_early_exit,
    inductor_cache,
    orch_home,
    own_tmp,
    record_early_exit,
    run_id,
    tmp_base,
)
from orchestrator.node import killed as kills
from orchestrator.node import retries
from orchestrator.node import stacks as stack_dump
from orchestrator.node.output import (
    STALLED,
    ErrorLines,
    first_error,
    notice,
    printable,
    verdict,
)
from orchestrator.node.procs import DEFAULT_GRACE, end_tree, subreaper
from orchestrator.node.script import output_dir_in
from orchestrator.node.watchdog import EXIT_STALLED, Bounds, Watchdog, hang_tools

if TYPE_CHECKING:
    from orchestrator.core.parallel import Sizes

POLL = 1.0
PEERS_PROBED = 256
HEAD_WAITS_FOR_NODES = 15.0  # for the other nodes' stack summaries, when the output dir is shared
STALL_GRACE = 3.0  # a hung rank has nothing left to save: SIGTERM, then SIGKILL soon after


class Peers:
    """Each node's launcher answers TCP connects on one port, so a stalled node can tell an unreachable node (a cut
    link, a dead host) from one that is only waiting. On emulated nodes sharing one address there is no network to
    fail, and no probe."""

    def __init__(self, rank: int, ips: tuple[str, ...], port: int):
        self.rank, self.ips, self.port = rank, ips, port
        self.sock: socket.socket | None = None
        if len(set(ips)) < len(ips):
            return
        family = socket.AF_INET6 if ":" in ips[rank] else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ips[rank], port))
            sock.listen(64)
        except OSError:
            return
        self.sock = sock
        threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
                conn.close()
            except OSError:
                return

    def _probe(self, rank: int) -> str:
        try:
            socket.create_connection((self.ips[rank], self.port), timeout=3).close()
            return ""
        except ConnectionRefusedError:
            return f"node {rank} ({self.ips[rank]}): reachable, but its node launcher is gone"
        except OSError:
            return f"node {rank} ({self.ips[rank]}): unreachable"

    def unreachable(self) -> list[str]:
        if self.sock is None:
            return []
        others = [r for r in range(len(self.ips)) if r != self.rank][:PEERS_PROBED]
        with ThreadPoolExecutor(max_workers=32) as pool:
            return [line for line in pool.map(self._probe, others) if line]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def read_progress(directory: str) -> dict[int, dict]:
    ranks = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
            ranks[int(record["rank"])] = record
        except (OSError, ValueError, KeyError):
            continue  # being replaced: read it at the next poll
    return ranks


def say(line: str, stream=None) -> None:
    """Print, and go on when no one reads our output any more (the local backend's orch was killed: its guard is
    ending this node, and a BrokenPipeError must not cut that short)."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except OSError:
        pass


class _Relay:
    """The child's output to ours, its first error lines kept, third-party notices nobody can act on held back
    (node/output.NOTICES; `hidden`); muted once a stall is declared (what the killed ranks print then is noise)."""

    def __init__(self, stream, cpu: bool, hide: bool = True, mask=lambda line: line):
        self.mask = mask  # secrets the environment holds never reach the node's log
        self.errors = ErrorLines()
        self.root_cause = kills.RootCause()  # torchrun's: names a rank a signal ended
        self.hidden: list[str] = []
        self.muted = False
        self.cpu, self.hide = cpu, hide
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream) -> None:
        continuing = False
        for line in iter(stream.readline, ""):
            line = self.mask(line)
            self.errors.feed(line)
            self.root_cause.feed(line)
            continuing = self.hide and notice(line, self.cpu, continuing)
            if continuing:
                self.hidden.append(line.rstrip("\n"))
                continue
            if not self.muted:
                try:
                    sys.stdout.write(printable(line))
                    sys.stdout.flush()
                except OSError:  # no reader: keep draining the child, so that it never blocks on a full pipe
                    self.muted = True
        stream.close()


def supervise(
    argv: list[str], env: Mapping[str, str], node_rank: int, ips: tuple[str, ...], probe_port: int, gpus: bool,
    settings: Mapping[str, object] | None = None, processes: int = 1, sizes: Sizes | None = None,
) -> int:
    """Run `argv` (accelerate launch) under the watchdog; return its exit code, or EXIT_STALLED. `settings`: the TRL
    settings the ranks run with, `processes` how many there are and `sizes` their parallelism config, for the fix a
    rank's out-of-memory error gets (core/memory_fix.py)."""
    from orchestrator.core.knobs import knob

    bounds = Bounds.from_env(env)
    progress_dir = tempfile.mkdtemp(prefix="orch-progress-")
    # the launch's temporary files go with it: torch's elastic agent makes a torchelastic_* directory in the temporary
    # directory at every launch and never removes it (one per launch on every node); torch.compile's cache stays where
    # torch keeps it without this TMPDIR, shared by every launch. A node whose TMPDIR orch made for the run has one.
    # Under a TMPDIR too long for DataLoader workers' sockets below it (a scheduler's per-job one) it lies in /tmp.
    launch_tmp = None
    if env.get("TMPDIR") != str(own_tmp(orch_home(env))):
        launch_tmp = tempfile.mkdtemp(prefix="orch-launch-", dir=tmp_base(len("/orch-launch-12345678")))
        if len(launch_tmp.encode()) > SOCKET_TMPDIR:
            say(f"[orch] warning: node {node_rank}: the ranks' TMPDIR {launch_tmp} is over {SOCKET_TMPDIR} bytes and "
                "/tmp cannot be written: DataLoader workers (dataloader_num_workers > 0) will fail with 'AF_UNIX path "
                "too long'; give the node a shorter TMPDIR")
    traces = os.path.join(orch_home(env), "nccl-traces", run_id(env) or "run")
    child_env = {
        **env,
        **({"TMPDIR": launch_tmp, "TORCHINDUCTOR_CACHE_DIR": inductor_cache(env)} if launch_tmp else {}),
        **({"ORCH_PROGRESS_DIR": progress_dir, "ORCH_NODE_PID": str(os.getpid())} if bounds.on else {}),
        **hang_tools(env, gpus, os.path.join(traces, "rank_")),
    }
    if gpus:
        os.makedirs(traces, exist_ok=True)
    subreaper()
    stopped: list[int] = []
    handlers = {
        sig: signal.signal(sig, lambda signum, _f: stopped.append(signum)) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    peers = Peers(node_rank, ips, probe_port)
    oom_before = kills.oom_kills()
    child = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")  # fmt: skip
    relay = _Relay(child.stdout, cpu=not gpus, hide=knob(env, "ORCH_SHOW_NOTICES", "off") == "off",
                   mask=credentials.Mask(credentials.from_env(env)))  # fmt: skip
    began = time.time()
    dog = Watchdog(bounds, started=began)
    grace = knob(env, "ORCH_STOP_GRACE", DEFAULT_GRACE)
    try:
        probed = 0.0
        while child.poll() is None and not stopped:
            time.sleep(POLL)
            ranks = read_progress(progress_dir) if bounds.on else {}
            if bounds.on and dog.busy(ranks) and time.time() - probed > PROBE_EVERY:  # a save must not hide a cut
                probed = time.time()
                dog.peers(peers.unreachable(), probed)
            reason = dog.observe(ranks, time.time()) if bounds.on else ""
            if reason and child.poll() is None:
                relay.muted = True
                line = _stalled(reason, node_rank, progress_dir, peers, traces)
                end_tree(STALL_GRACE, child)
                say(line, sys.stderr)
                seen = read_progress(progress_dir)
                where = _reported_dir(seen) or output_dir_in(argv)  # a rank that never reported: its argv's
                if stop := retries.give_up(where, node_rank, _last_step(seen), env):
                    ended = child.wait()  # the watchdog ended it: a signal's code, as the verdict says it
                    say(verdict(node_rank, ended if ended >= 0 else 128 - ended,
                                f"orch: error: {stop}: {line.removeprefix('orch: error: ')}"))  # fmt: skip
                    return 1
                return EXIT_STALLED
    except KeyboardInterrupt:
        stopped.append(signal.SIGINT)
    finally:
        if child.poll() is None:
            end_tree(grace, child)
        child.wait()
        relay.thread.join(timeout=5)
        peers.close()
        last = read_progress(progress_dir)
        output_dir = _reported_dir(last)
        shutil.rmtree(progress_dir, ignore_errors=True)
        if launch_tmp:
            shutil.rmtree(launch_tmp, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stopped:
        return 128 + stopped[0]
    code = child.returncode if child.returncode >= 0 else 128 - child.returncode
    if relay.hidden and not code:
        say(f"[orch] node {node_rank}: hid {len(relay.hidden)} line(s) of third-party notices that need no action "
            "(node/output.py NOTICES; ORCH_SHOW_NOTICES=on shows them)")  # fmt: skip
    if code:
        for line in relay.hidden:  # a failing node hides nothing
            say(line)
        error = first_error(relay.errors)
        # a rank a signal ended wrote no error of its own: the others' are what its loss made them see. But an abort
        # after a network or GPU failure (NCCL's watchdog aborts a rank whose collective timed out) stays retryable.
        killed = relay.root_cause.killed
        if killed and (killed.name == "SIGKILL" or not retryable(error)):
            line = kills.cause(killed, node_rank, last.get(killed.rank, {}).get("step"), oom_before, kills.oom_kills())
            if output_dir:  # where the other nodes look: the cause of the network errors they see
                record_early_exit(output_dir, killed.rank, node_rank, line)
            say(f"orch: error: {line}")
            say(verdict(node_rank, code, line))
            return 1
        # a rank that left early is the cause, not the network error it made the others see
        if retryable(error) and (early := _left_early(output_dir, since=began - 60)):
            say(verdict(node_rank, code, f"orch: error: {early} (this node then saw: {error})"))
            return 1
        if settings is not None and (fix := memory_fix.advice(error, settings, env, processes, sizes)):
            say(f"[orch] {fix}")  # before the failure line, which stays the last
        if retryable(error):  # the cluster's failure: exit 75, which a managed job recovers from
            where = output_dir or output_dir_in(argv)  # a rank that failed before its first report: its argv's
            if stop := retries.give_up(where, node_rank, _last_step(last), env):
                say(verdict(node_rank, code, f"orch: error: {stop}: {error}"))
                return 1
            say(verdict(node_rank, code, error, exits=EXIT_STALLED))
            return EXIT_STALLED
        say(verdict(node_rank, code, error))
    return code


PROBE_EVERY = 10.0
"""Seconds between probes of the other nodes while a rank saves, evaluates or writes the final model."""
EARLY_WAIT = 5.0
"""Seconds a failing node waits for another node's early-exit record to reach the shared output dir."""


def _reported_dir(ranks: Mapping[int, dict]) -> str:
    """The output dir this node's ranks reported (train/progress.py), '' before any did."""
    return next((r["output_dir"] for r in ranks.values() if r.get("output_dir")), "")


def _last_step(ranks: Mapping[int, dict]) -> int | None:
    """The furthest step a rank of this node reported (None before any report)."""
    steps = [r["step"] for r in ranks.values() if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def _left_early(output_dir: str, since: float) -> str:
    """The first rank that left before training ended in this attempt (train/entry.run records it), or ''."""
    if not output_dir:
        return ""
    deadline = time.monotonic() + EARLY_WAIT
    while (first := first_early_exit(output_dir, since)) is None and time.monotonic() <= deadline:
        time.sleep(0.5)
    return str(first.get("error", "")) if first else ""


def _stalled(reason: str, node: int, progress_dir: str, peers: Peers, traces: str) -> str:
    """Dump, print and save where every rank of this node waits; return the one `orch: error:` line."""
    ranks = read_progress(progress_dir)
    tool = "py-spy" if stack_dump.py_spy() else "faulthandler"
    say(f"[orch] node {node}: stalled: {reason}; dumping the stacks of {len(ranks)} rank(s) with {tool}")
    with ThreadPoolExecutor(max_workers=8) as pool:
        dumps = list(pool.map(lambda r: stack_dump.dump(r["rank"], r["pid"], r["step"], progress_dir),
                              sorted(ranks.values(), key=lambda r: r["rank"])))  # fmt: skip
    output_dir = next((r["output_dir"] for r in ranks.values() if r.get("output_dir")), "")
    hang_dir = Path(output_dir) / "orch" / "hang" if output_dir else Path(traces).parent.parent / "hang"
    try:
        hang_dir.mkdir(parents=True, exist_ok=True)
        for d in dumps:
            (hang_dir / f"node{node}-rank{d.rank}.txt").write_text(f"# {d.line()} ({d.tool})\n{d.text}")
        summary = [{"rank": d.rank, "step": d.step, "state": d.state, "frames": d.frames} for d in dumps]
        (hang_dir / f"node{node}.json").write_text(json.dumps(summary))
        for trace in Path(traces).glob("rank_*"):  # the NCCL flight recorder's dumps, if NCCL's watchdog fired
            shutil.copy(trace, hang_dir / trace.name)
    except OSError as exc:
        say(f"[orch] node {node}: could not write the stacks under {hang_dir}: {exc.strerror}")
    for d in dumps:
        say(f"[orch] node {node}: {d.line()}")
    lost = peers.unreachable()
    for line in lost:
        say(f"[orch] node {node}: {line}")
    everyone = dumps + (_other_nodes(hang_dir, node, len(peers.ips)) if node == 0 else [])
    odd = stack_dump.odd_ones(everyone)
    culprit = (
        "not where the others are: " + "; ".join(d.line() for d in odd)
        if odd
        else "every rank waits at the same place"
        if len(everyone) > 1
        else ""
    )
    parts = [f"{STALLED}{node}: {reason}", *lost, culprit, f"stacks in {hang_dir}"]
    return "; ".join(p for p in parts if p)


def _other_nodes(hang_dir: Path, node: int, nodes: int) -> list[stack_dump.RankStack]:
    """The head names the odd rank over every node whose summary reaches the shared output dir in time."""
    found: dict[int, list] = {}
    deadline = time.monotonic() + (HEAD_WAITS_FOR_NODES if nodes > 1 else 0)
    while len(found) < nodes - 1 and time.monotonic() < deadline:
        for other in range(nodes):
            path = hang_dir / f"node{other}.json"
            if other != node and other not in found and path.is_file() and path.stat().st_mtime > time.time() - 120:
                try:
                    found[other] = json.loads(path.read_text())
                except ValueError:
                    continue
        time.sleep(0.5)
    return [
        stack_dump.RankStack(r["rank"], 0, r["step"], r["state"], [tuple(f) for f in r["frames"]], "", "")
        for summaries in found.values()
        for r in summaries
    ]
