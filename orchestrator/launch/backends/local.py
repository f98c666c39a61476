"""Local backend: N emulated nodes on this machine, each running the recipe's `run:` as SkyPilot would.

Every node gets SkyPilot's environment (NODE_IPS = N lines of 127.0.0.1, ranks 0..N-1), so `orch node`
computes the same multi-node `accelerate launch` as on a cluster and all ranks rendezvous over loopback
into ONE process group. Gang semantics: the first node to fail stops the others. CPU cores are split
between the processes (OMP_NUM_THREADS), since oversubscribed threads make a tiny run 10x slower.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core import credentials, final_model
from orchestrator.core.errors import OrchError, retryable
from orchestrator.core.home import first_early_exit
from orchestrator.core.knobs import knob
from orchestrator.core.summary import stop_reason, summary
from orchestrator.launch.backends import netns
from orchestrator.launch.backends.local_nodes import free_ports, node_envs, node_scratch, threads_per_process
from orchestrator.node.output import VERDICT, ErrorLines, error_of, first_error, printable
from orchestrator.node.procs import DEFAULT_GRACE, stopped_group

GUARD = "orchestrator.launch.backends.guard"


@dataclass
class LocalResult:
    returncode: int
    failed_node: int | None
    """Rank of the first node that exited non-zero, if any."""
    stopped: str = ""
    """Why a successful run stopped before its last step (the cost cap), from rank 0's report."""
    error: str = ""
    """The first real error line of the failing node (a Python exception, an orch error), not a launcher's summary."""
    codes: tuple[int | None, ...] = ()
    """Every node's exit code, by node rank."""


TAIL_LINES = 15


def _pump(stream, prefix: str, lock: threading.Lock, sink, tail: deque, errors: ErrorLines, verdicts: list[str],
          mask) -> None:
    for line in iter(stream.readline, ""):
        line = mask(printable(line))  # run.log and the terminal never show a secret the nodes print
        tail.append(line)
        if (verdict := VERDICT.match(line.strip())) and (said := verdict.group("error")):
            # the node's own reading of its failure (node/supervise.py), as an error line: a kill's cause is quoted bare
            verdicts.append(error_of(said) or f"orch: error: {said}")
        else:
            errors.feed(line)
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def _stop(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
        if sig == signal.SIGTERM:
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on its SIGTERM only once continued
    except (ProcessLookupError, PermissionError):
        pass


def run_nodes(
    run_script: str,
    envs: list[dict[str, str]],
    workdir: Path,
    sink=None,
    hold_fds: tuple[int, ...] = (),
    prefixes: list[list[str]] | None = None,
    secrets: Iterable[str] = (),
    cause: Callable[[LocalResult], LocalResult] = lambda result: result,
) -> LocalResult:
    """Start one `bash -c run_script` per node env, each under a guard (orchestrator/launch/backends/guard.py) that
    ends the node's whole process tree when orch stops it or dies; return when all finish or the first one fails.
    hold_fds (the run lock) stay open in the guards, so they are held until the last node is gone; prefixes[i] runs
    node i's guard (`ip netns exec NS` for --netns). Their output is masked: `secrets` and credential-named envs.
    `cause`: the failure to report, from the first node's to fail (`_root_cause`), whose last lines are shown."""
    sink = sink or sys.stdout
    mask = credentials.Mask([*secrets, *(credentials.from_env(envs[0]) if envs else [])])
    lock = threading.Lock()
    base = dict(os.environ)
    # The node must find `orch` and `accelerate` of this Python's environment, as `setup:` would install them.
    base["PATH"] = str(Path(sys.executable).parent) + os.pathsep + base.get("PATH", "")
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tails: list[deque] = []
    errors: list[ErrorLines] = []
    verdicts: list[list[str]] = []
    grace = knob(envs[0] if envs else {}, "ORCH_STOP_GRACE", DEFAULT_GRACE)  # what the guards will wait
    watch, alive = os.pipe()  # orch holds `alive` (close-on-exec): its end closes when orch ends, however it ends
    try:
        for rank, env in enumerate(envs):
            proc = subprocess.Popen(
                [
                    *(prefixes[rank] if prefixes else []),
                    sys.executable,
                    "-m",
                    GUARD,
                    str(watch),
                    "--",
                    "bash",
                    "-c",
                    run_script,
                ],  # fmt: skip
                cwd=workdir,
                env={**base, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,  # its own process group: a terminal's Ctrl-C reaches orch only
                pass_fds=(watch, *hold_fds),
            )
            procs.append(proc)
            tails.append(deque(maxlen=TAIL_LINES))
            errors.append(ErrorLines())
            verdicts.append([])
            pump = threading.Thread(
                target=_pump,
                args=(proc.stdout, f"(node{rank}) ", lock, sink, tails[-1], errors[-1], verdicts[-1], mask),
                daemon=True,
            )
            pump.start()
            pumps.append(pump)
        failed, finished, late = None, None, ""
        exit_wait = knob(envs[0] if envs else {}, "ORCH_NODE_EXIT_WAIT", DEFAULT_EXIT_WAIT)
        while failed is None and any(p.poll() is None for p in procs):
            for rank, proc in enumerate(procs):
                if proc.poll() not in (None, 0):
                    failed = rank
                    break
            if failed is None and finished is None and any(p.poll() == 0 for p in procs):
                finished = time.monotonic()  # one node is done: the others finish the same steps within moments
            if failed is None and finished is not None and time.monotonic() - finished > exit_wait:
                failed = next(rank for rank, p in enumerate(procs) if p.poll() is None)
                late = (f"node {failed} did not exit {exit_wait:g} s after node "
                        f"{next(r for r, p in enumerate(procs) if p.poll() == 0)} finished its training"
                        f"{stopped_group(procs[failed].pid)} (ORCH_NODE_EXIT_WAIT={exit_wait:g})")  # fmt: skip
                errors[failed].insert(0, f"orch: error: {late}")
            time.sleep(0.05)
        if failed is None:
            failed = next((rank for rank, p in enumerate(procs) if p.returncode != 0), None)
        if failed is not None:
            code = procs[failed].returncode
            with lock:
                sink.write(f"[orch] {late}: stopping it\n" if late else
                           f"[orch] node {failed} exited with code {code}: stopping the other nodes\n")  # fmt: skip
                sink.flush()
            _stop_all(procs, grace)
    except BaseException:
        with _signals_held():  # a second Ctrl-C must not cut the stop short (the guards would still end the nodes)
            _stop_all(procs, grace)
        raise
    finally:
        os.close(watch)
        os.close(alive)
        for pump in pumps:
            pump.join(timeout=5)
    if failed is None:
        return LocalResult(0, None)
    code = procs[failed].returncode if not late else 1
    # The node's verdict, as a cloud run's last line quotes it (launch/job_end.py): what its supervisor made of its
    # ranks' errors (a rank that left early, a node that stopped asking to be retried), else its first error line.
    said = verdicts[failed][-1] if verdicts[failed] and not late else first_error(errors[failed])
    result = cause(LocalResult(code or 1, failed, error=said,
                               codes=tuple(p.returncode for p in procs)))  # fmt: skip
    # The failing node's last lines, together: interleaved with the others' they are hard to find.
    shown = result.failed_node if result.failed_node is not None else failed
    sink.write(f"[orch] last {len(tails[shown])} lines of node {shown}:\n")
    for line in tails[shown]:
        sink.write(f"  (node{shown}) {line}")
    sink.flush()
    return result


DEFAULT_EXIT_WAIT = 120.0
"""ORCH_NODE_EXIT_WAIT: seconds the other nodes may take to exit once one finished cleanly (the final model's save
and the exit barrier take seconds): past it the late node is named and stopped, not waited for forever."""


class _signals_held:
    """Ignore SIGINT/SIGTERM/SIGHUP for a block (main thread only), then restore the handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in self.SIGNALS}

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def _stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every node's process group; each guard then ends its tree (SIGKILL after its grace, the same
    ORCH_STOP_GRACE). A guard that outlives its grace and a margin is killed with its group."""
    for proc in procs:
        if proc.poll() is None:
            _stop(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(proc, signal.SIGKILL)
            proc.wait()
    for proc in procs:  # children that outlived their bash
        _stop(proc, signal.SIGKILL)


class _Tee:
    """Node output to the terminal and to <output_dir>/orch/run.log (read by `orch logs`)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> None:
        for stream in self.streams:
            try:
                stream.write(text)
            except (OSError, ValueError):  # the terminal is gone (SIGHUP, a closed pipe): the log file goes on
                pass

    def flush(self) -> None:
        for stream in self.streams:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def _root_cause(result: LocalResult, output_dir: Path, since: float) -> LocalResult:
    """The node a rank that left early ran on, when one did (home.record_early_exit): the first node to exit is often
    another, ended by the network error that rank's leaving caused (it quotes the record, as a cloud node's last line
    does), and the record's node may still have been saying so when orch stopped it."""
    if not retryable(result.error):  # its own failure (every node's, when all ranks diverge at one step)
        return result
    early = first_early_exit(output_dir, since) or {}
    node = early.get("node")
    if not isinstance(node, int) or node == result.failed_node or not 0 <= node < len(result.codes):
        return result
    code = result.codes[node]
    code = code if code is not None and 0 < code < 128 else 1  # 1: what its launcher exits with once it recorded it
    return dataclasses.replace(result, failed_node=node, returncode=code, error=f"orch: error: {early.get('error')}")


def output_dir_of(launch, run_id: str) -> str:
    """Where the node launcher will put the run (CHECKPOINT_ROOT/<run id>, else the TRL output_dir override)."""
    from orchestrator.node.script import checkpoint_dir

    root = launch.envs.get("CHECKPOINT_ROOT", "").strip()
    if root:
        return checkpoint_dir(root, run_id)
    # ~ as the ranks read it (transformers' TrainingArguments expands it), not a folder named ~ in the workdir
    return os.path.expanduser(str(launch.overrides.get("output_dir", f"outputs/{run_id}")))


def forget(output_dir: Path, run_id: str, workdir: Path) -> None:
    """--fresh: delete the run's output directory (its checkpoints), so that it starts from step 0; only a directory
    orch made for this run (core/owned.py), else one line naming what to delete by hand."""
    from orchestrator.core import owned
    from orchestrator.core.final_model import size_words

    if output_dir.is_dir() and not owned.why_not_removable(output_dir, run_id, also=(workdir,)):
        numbered = [p.name for p in output_dir.glob("checkpoint-*") if p.name[11:].isdigit()]
        found = sorted(numbered, key=lambda name: int(name[11:])) or ["no checkpoint"]
        size = sum(p.lstat().st_size for p in output_dir.rglob("*") if p.is_file() and not p.is_symlink())
        final = " and the final model" if (output_dir / "config.json").is_file() else ""
        print(f"[orch] --fresh: deleting {output_dir}: {', '.join(found)} ({size_words(size)}){final}", flush=True)
    owned.remove(output_dir, run_id, "--fresh", also=(workdir,))


def prepare(resolved, run_id: str, fresh: bool, check_only: bool = False) -> Path:
    """The run's output directory, ready before anything else is written: emptied with --fresh (`forget`), made and
    marked as this run's when new, and its `orch/` reports directory renewed (reports describe one run; checkpoints
    stay for resuming). Refusals are OrchErrors; check_only raises them and changes nothing (before the run lock)."""
    from orchestrator.core import owned

    workdir = resolved.recipe.workdir
    output_dir = workdir / output_dir_of(resolved, run_id)
    reports = output_dir / "orch"
    if fresh:  # the whole directory goes, reports included
        what, why = "--fresh", owned.why_not_removable(output_dir, run_id, also=(workdir,))
    elif why := owned.why_foreign(output_dir, also=(workdir,)):  # the final model would land among others' files
        given = resolved.overrides.get("output_dir")
        what = f"output_dir={given}" if given is not None else "the run's output directory"
        why += (f"; {final_model.WRITTEN} would overwrite same-named ones there and transformers deletes "
                "checkpoint-* folders in it: give the run a new or empty directory (output_dir=outputs/my_run)")
    else:
        what, why = "the run's reports directory", owned.why_not_removable(reports, None, also=(workdir,))
    if why:
        raise OrchError(f"{what}: {why}")
    if check_only:
        return output_dir
    if fresh:
        forget(output_dir, run_id, workdir)
    elif (other := owned.marker_run(output_dir) or owned.marker_run(reports)) and other != run_id:
        print(f"[orch] output: {output_dir} holds run {other}'s files: this run resumes from its checkpoints where "
              "their settings match (its ranks compare them; ORCH_RESUME_CHANGED=on resumes anyway), and --fresh "
              "leaves that directory alone", flush=True)  # fmt: skip
    owned.claim(output_dir, run_id)  # an existing directory orch did not make stays unmarked: --fresh refuses it
    owned.remove(reports, None, "the run's reports directory", also=(workdir,))
    owned.claim(reports, run_id)
    return output_dir


def launch(
    resolved, run_id: str, secrets: dict | None = None, token: str = "", hold_fds=(), network=None
) -> LocalResult:
    """Run a resolved launch (orchestrator.launch.resolved.Launch) on emulated nodes and print what ran.
    token marks every process of the run (ORCH_RUN_TOKEN) for `orch status` to reap; hold_fds go to the guards;
    network (netns.Network, entered) puts each node in its own namespace."""
    recipe = resolved.recipe
    workdir = recipe.workdir
    envs = resolved.env()
    nodes, procs_per_node = resolved.nodes, resolved.gpus.count
    output_dir = workdir / output_dir_of(resolved, run_id)
    total = nodes * procs_per_node
    print(
        f"[orch] run {run_id}: recipe {recipe.name} ({envs['TRL_TRAINER']}) on {nodes} emulated node(s) x "
        f"{procs_per_node} CPU process(es) = world size {total}, {threads_per_process(total)} thread(s) each",
        flush=True,
    )
    print(f"[orch] output: {output_dir}", flush=True)
    if recipe.task.get("setup"):
        print("[orch] local: skipping the recipe's `setup:` (this environment is already installed)", flush=True)
    started, launched = time.monotonic(), time.time()
    if network:
        print(f"[orch] network: node i in namespace {network.namespaces[0][:-1]}<i>, at {', '.join(network.ips)}",
              flush=True)  # fmt: skip
    (output_dir / "orch").mkdir(parents=True, exist_ok=True)
    with node_scratch(run_id, nodes, output_dir) as scratch, open(output_dir / "orch" / "run.log", "w") as log:
        # Secrets travel in the node processes' environment only (as SkyPilot secrets do), never in files or argv.
        port, barrier_port = free_ports(2)
        node_env = node_envs(
            {**envs, **(secrets or {}), **({"ORCH_RUN_TOKEN": token} if token else {})},
            nodes,
            procs_per_node,
            task_id=run_id,
            port=port,
            barrier_port=barrier_port,
            launched_at=time.time(),
            ips=network.ips if network else None,
            iface=netns.IFACE if network else "",
            scratch=scratch,
        )
        prefixes = [network.prefix(i) for i in range(nodes)] if network else None
        result = run_nodes(str(recipe.task["run"]), node_env, workdir, _Tee(sys.stdout, log), hold_fds, prefixes,
                           secrets=(secrets or {}).values(),
                           cause=lambda first: _root_cause(first, output_dir, since=launched))  # fmt: skip
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        print(
            f"[orch] failed after {elapsed:.1f} s: node {result.failed_node} exited with code {result.returncode}"
            + (f": {result.error}" if result.error else f" (its log lines are prefixed (node{result.failed_node}))"),
            flush=True,
        )
        return result
    print(f"[orch] finished in {elapsed:.1f} s", flush=True)
    for line in summary(output_dir):
        print(line, flush=True)
    result.stopped = stop_reason(output_dir)
    return result
