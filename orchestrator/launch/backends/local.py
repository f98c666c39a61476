"""Local backend: N emulated nodes on this machine, each running the recipe's `run:` as SkyPilot would.

Every node gets SkyPilot's environment (NODE_IPS = N lines of 127.0.0.1, ranks 0..N-1), so `orch node`
computes the same multi-node `accelerate launch` as on a cluster and all ranks rendezvous over loopback
into ONE process group. Gang semantics: the first node to fail stops the others. CPU cores are split
between the processes (OMP_NUM_THREADS), since oversubscribed threads make a tiny run 10x slower.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.timeline import time_to_first_step

STOP_GRACE_SECONDS = 10.0


@dataclass
class LocalResult:
    returncode: int
    failed_node: int | None
    """Rank of the first node that exited non-zero, if any."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_per_process(total_processes: int, cores: int | None = None) -> int:
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, total_processes))


def node_envs(
    task_envs: Mapping[str, str],
    nodes: int,
    procs_per_node: int,
    task_id: str,
    port: int,
    barrier_port: int,
    launched_at: float = 0.0,
) -> list[dict[str, str]]:
    """The environment of each emulated node (pure: the caller adds os.environ)."""
    threads = threads_per_process(nodes * procs_per_node)
    envs = []
    for rank in range(nodes):
        env = dict(task_envs)
        env.update(
            SKYPILOT_NODE_RANK=str(rank),
            SKYPILOT_NODE_IPS="127.0.0.1\n" * nodes,
            SKYPILOT_NUM_NODES=str(nodes),
            SKYPILOT_NUM_GPUS_PER_NODE=str(procs_per_node),
            SKYPILOT_TASK_ID=task_id,
            MAIN_PROCESS_PORT=str(port),
            ORCH_BARRIER_PORT=str(barrier_port),
            ORCH_DEVICE="cpu",
            OMP_NUM_THREADS=str(threads),
            ORCH_LAUNCHED_AT=f"{launched_at:.3f}",
            ORCH_VENV=sys.prefix,  # the recipe's `run:` puts ORCH_VENV/bin first on PATH, as on a node
            ORCH_HOME=str(Path(tempfile.gettempdir()) / f"orch-local-{task_id}-node{rank}"),  # no setup ran here
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_DATASETS_DISABLE_PROGRESS_BARS="1",
            PYTHONWARNINGS="ignore::FutureWarning",
            PYTHONUNBUFFERED="1",
        )
        envs.append(env)
    return envs


TAIL_LINES = 15


def _pump(stream, prefix: str, lock: threading.Lock, sink, tail: deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line)
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def _stop(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_nodes(
    run_script: str,
    envs: list[dict[str, str]],
    workdir: Path,
    sink=None,
) -> LocalResult:
    """Start one `bash -c run_script` per node env; return when all finish or the first one fails."""
    sink = sink or sys.stdout
    lock = threading.Lock()
    base = dict(os.environ)
    # The node must find `orch` and `accelerate` of this Python's environment, as `setup:` would install them.
    base["PATH"] = str(Path(sys.executable).parent) + os.pathsep + base.get("PATH", "")
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tails: list[deque] = []
    try:
        for rank, env in enumerate(envs):
            proc = subprocess.Popen(
                ["bash", "-c", run_script],
                cwd=workdir,
                env={**base, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,  # its own process group, so the gang stop reaches torchrun's children
            )
            procs.append(proc)
            tails.append(deque(maxlen=TAIL_LINES))
            pump = threading.Thread(
                target=_pump, args=(proc.stdout, f"(node{rank}) ", lock, sink, tails[-1]), daemon=True
            )
            pump.start()
            pumps.append(pump)
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            for rank, proc in enumerate(procs):
                if proc.poll() not in (None, 0):
                    failed = rank
                    break
            time.sleep(0.05)
        if failed is None:
            failed = next((rank for rank, p in enumerate(procs) if p.returncode != 0), None)
        if failed is not None:
            code = procs[failed].returncode
            with lock:
                sink.write(f"[orch] node {failed} exited with code {code}: stopping the other nodes\n")
                sink.flush()
            _stop_all(procs)
    except BaseException:
        _stop_all(procs)
        raise
    finally:
        for pump in pumps:
            pump.join(timeout=5)
    if failed is None:
        return LocalResult(0, None)
    # The failing node's last lines, together: interleaved with the others' they are hard to find.
    sink.write(f"[orch] last {len(tails[failed])} lines of node {failed}:\n")
    for line in tails[failed]:
        sink.write(f"  (node{failed}) {line}")
    sink.flush()
    return LocalResult(procs[failed].returncode or 1, failed)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            _stop(proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
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
            stream.write(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def ran_as(report: dict) -> str:
    """`FSDP2`, `DeepSpeed ZeRO-3`, `MULTI_CPU` (DDP): a rank's report, read back from the training process."""
    facts = report.get("strategy") or {}
    if "fsdp_version" in facts:
        return f"FSDP{facts['fsdp_version']}"
    if "zero_stage" in facts:
        sp = f" + Ulysses SP{facts['sp_size']}" if facts.get("sp_size") else ""
        return f"DeepSpeed ZeRO-{facts['zero_stage']}{sp}"
    return report["distributed_type"]


def sharding_line(ranks: list[dict]) -> str | None:
    """How many parameters each rank held sharded (DTensor under FSDP2, ZeRO-3 partitions), per the ranks."""
    facts = [r.get("strategy") or {} for r in ranks]
    if not facts or "params" not in facts[0]:
        return None
    head = facts[0]
    what = "DTensor" if "fsdp_version" in head else "ZeRO-3 partitions"
    sharded = min(f["sharded_params"] for f in facts)
    text = f"[orch] sharded: {sharded}/{head['params']} parameters on every rank ({what})"
    stage = head.get("zero_stage", 3)
    if stage < 3:
        states = "optimizer states and gradients" if stage == 2 else "optimizer states"
        text = f"[orch] sharded: {states} (ZeRO-{stage}); parameters replicated on every rank"
    if "ref_params" in head:
        text += f", reference model {min(f['ref_sharded_params'] for f in facts)}/{head['ref_params']}"
    if "state_dict_type" in head:
        text += f"; checkpoints as {head['state_dict_type']}"
    return text


def checkpoint_format(checkpoint: Path) -> str:
    """What the files say: FSDP's distributed checkpoint shards, DeepSpeed's per-rank ZeRO states, or nothing."""
    shards = sorted(checkpoint.glob("pytorch_model_fsdp_*/*.distcp"))
    if shards:
        return f" (sharded: {len(shards)} distcp shard file(s) in {shards[0].parent.name}/)"
    states = sorted(checkpoint.glob("global_step*/*optim_states.pt"))  # one per rank at every ZeRO stage
    if states:
        return f" (DeepSpeed: {len(states)} per-rank optimizer state file(s) in {states[0].parent.name}/)"
    return ""


def _summary(output_dir: Path) -> list[str]:
    """What really ran, from the per-rank reports the training processes wrote (orchestrator/train.py)."""
    import json

    reports = sorted((output_dir / "orch").glob("rank*.json"))
    if not reports:
        return [f"[orch] no training report in {output_dir / 'orch'}: the training did not finish"]
    ranks = [json.loads(p.read_text()) for p in reports]
    head = ranks[0]
    world = head["world_size"]
    lines = [
        f"[orch] ran: {ran_as(head)} over {head['backend'] or 'no process group'}, world size {world} "
        f"(ranks reporting: {', '.join(str(r['rank']) for r in ranks)})"
    ]
    sharding = sharding_line(ranks)
    if sharding:
        lines.append(sharding)
    steps = head["optimizer_steps_this_run"]
    if not steps and head.get("resumed_from"):
        lines.append(
            f"[orch] resumed from {head['resumed_from']} at step {head['optimizer_steps']}, already the last step: "
            f"nothing left to train (rerun with --fresh to start over)"
        )
    if steps:
        per_step = head["total_samples"] / steps
        lines.append(
            f"[orch] {steps} optimizer steps x {per_step:g} samples "
            f"(= {head['per_device_train_batch_size']} per device x {head.get('data_parallel_ranks', world)} "
            "data-parallel ranks x "
            f"{head['gradient_accumulation_steps']} accumulation)"
        )
    log = output_dir / "orch" / "log.jsonl"
    losses = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    losses = [r for r in losses if "loss" in r]
    if losses:
        lines.append(
            f"[orch] loss: step {losses[0]['step']} {losses[0]['loss']:.4f} -> step {losses[-1]['step']} "
            f"{losses[-1]['loss']:.4f}"
        )
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if checkpoints:
        lines.append(f"[orch] checkpoint: {checkpoints[-1]}{checkpoint_format(checkpoints[-1])}")
    if head.get("timeline", {}).get("first_step"):
        lines.append(f"[orch] time to first step: {time_to_first_step(head['timeline'])}")
    final = head.get("final_model")
    if final and final["loadable"]:
        lines.append(
            f"[orch] final model: {final['path']} ({', '.join(final['weights'])}, {final['bytes'] / 1e6:.1f} MB), "
            "Hugging Face format: transformers' from_pretrained loads it"
        )
    else:
        lines.append(f"[orch] final model: NOT written in Hugging Face format in {output_dir}")
    return lines


def output_dir_of(launch, run_id: str) -> str:
    """Where the node launcher will put the run (CHECKPOINT_ROOT/<run id>, else the TRL output_dir override)."""
    from orchestrator.node.script import checkpoint_dir

    root = launch.envs.get("CHECKPOINT_ROOT", "").strip()
    if root:
        return checkpoint_dir(root, run_id)
    return str(launch.overrides.get("output_dir", f"outputs/{run_id}"))


def forget(launch, run_id: str) -> None:
    """--fresh: delete the run's output directory (its checkpoints), so that it starts from step 0."""
    import shutil

    path = Path(output_dir_of(launch, run_id))
    if path.is_dir():
        print(f"[orch] --fresh: deleting {path} (earlier checkpoints of this run)", flush=True)
        shutil.rmtree(path)


def launch(resolved, run_id: str, secrets: dict | None = None) -> int:
    """Run a resolved launch (orchestrator.launch.resolved.Launch) on emulated nodes and print what ran.
    Returns the exit code for the CLI."""
    import shutil

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
    if (output_dir / "orch").is_dir():
        shutil.rmtree(output_dir / "orch")  # reports describe one run; checkpoints stay for resuming
    started = time.monotonic()
    # Secrets travel in the node processes' environment only (as SkyPilot secrets do), never in files or argv.
    node_env = node_envs(
        {**envs, **(secrets or {})},
        nodes,
        procs_per_node,
        task_id=run_id,
        port=free_port(),
        barrier_port=free_port(),
        launched_at=time.time(),
    )
    (output_dir / "orch").mkdir(parents=True, exist_ok=True)
    with open(output_dir / "orch" / "run.log", "w") as log:
        result = run_nodes(str(recipe.task["run"]), node_env, workdir, sink=_Tee(sys.stdout, log))
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        print(
            f"[orch] failed after {elapsed:.1f} s: node {result.failed_node} exited with code "
            f"{result.returncode} (its log lines are prefixed (node{result.failed_node}))",
            flush=True,
        )
        return result.returncode
    print(f"[orch] finished in {elapsed:.1f} s", flush=True)
    for line in _summary(output_dir):
        print(line, flush=True)
    return 0
