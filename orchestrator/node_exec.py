"""Node side, with effects: `orch node` prints or execs the plan of node.py, after orch's barrier; a vLLM
server node serves until the trainers are done."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from orchestrator.errors import OrchError
from orchestrator.node import DEFAULT_PORT, env_port, plan_from_env, render
from orchestrator.topology import Topology, from_env


def run(print_only: bool, env: Mapping[str, str] | None = None) -> int:
    """`orch node`: print the plan, then exec accelerate (replacing this process) unless print_only."""
    env = os.environ if env is None else env
    node_plan = plan_from_env(env, cpus=usable_cpus())
    if print_only:
        print(render(node_plan.argv, node_plan.env))
        return 0
    topo = node_plan.topology
    if node_plan.role == "vllm-server":
        _barrier(env, from_env(env))
        print(
            f"[orch] node {env.get('SKYPILOT_NODE_RANK')}: vLLM server for the trainers on {topo.nodes} node(s)",
            flush=True,
        )
        print("[orch] run: " + render(node_plan.argv), flush=True)
        return serve_until_training_ends(
            node_plan.argv, topo.head_ip, int(env.get("MAIN_PROCESS_PORT") or DEFAULT_PORT)
        )
    _barrier(env, from_env(env))
    print(
        f"[orch] node {topo.node_rank}/{topo.nodes}: {topo.gpus_per_node} process(es) here, "
        f"{topo.total_gpus} in all, head {topo.head_ip}, running {node_plan.runs_as}",
        flush=True,
    )
    for note in node_plan.notes:
        print(f"[orch] note: {note}", flush=True)
    print("[orch] exec: " + render(node_plan.argv, node_plan.env), flush=True)
    sys.stdout.flush()
    try:
        os.execvpe(node_plan.argv[0], node_plan.argv, {**env, **node_plan.env})
    except FileNotFoundError:
        raise OrchError(
            "`accelerate` is not on PATH on this node; the recipe's setup must pip install '.[train]'"
        ) from None
    return 0  # not reached


def usable_cpus() -> int:
    """Cores this process may run on (a container's cpuset, not the host's count, where the OS says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def _barrier(env: Mapping[str, str], topo: Topology) -> None:
    """Every node of a multi-node run passes orch's barrier before starting accelerate (rendezvous.py)."""
    if topo.nodes < 2:
        return
    from orchestrator import rendezvous

    main_port = int(env_port(env, "MAIN_PROCESS_PORT", DEFAULT_PORT))
    port = int(env_port(env, "ORCH_BARRIER_PORT", main_port + 1))
    raw = env.get("ORCH_RENDEZVOUS_TIMEOUT", "").strip() or str(rendezvous.DEFAULT_TIMEOUT)
    try:
        timeout = float(raw)
    except ValueError:
        raise OrchError(f"ORCH_RENDEZVOUS_TIMEOUT={raw!r} is not a number of seconds") from None
    print(
        f"[orch] node {topo.node_rank}: waiting for all {topo.nodes} nodes at {topo.head_ip}:{port} "
        f"(timeout {timeout:g} s)",
        flush=True,
    )
    if topo.node_rank == 0:
        took = rendezvous.head_wait(topo.nodes, port, timeout)
    else:
        took = rendezvous.worker_join(topo.node_rank, topo.head_ip, port, timeout)
    print(f"[orch] node {topo.node_rank}: all {topo.nodes} nodes joined in {took:.1f} s", flush=True)


def _port_open(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def serve_until_training_ends(
    argv: list[str], head_ip: str, head_port: int, env: Mapping[str, str] | None = None
) -> int:
    """Run the vLLM server until the trainers' rendezvous on the head node has opened and then closed.

    The trainers' job ends when their torchrun exits, which closes its store on head_ip:head_port; the server
    node then stops its server and exits 0 so that the SkyPilot job completes. If the server dies on its
    own, its exit code is returned (and the whole job fails, as it should: the trainers cannot generate).
    """
    import subprocess
    import time

    env = os.environ if env is None else env
    poll = float(env.get("ORCH_VLLM_POLL_SECONDS", "10"))
    grace = int(env.get("ORCH_VLLM_CLOSED_POLLS", "3"))
    try:
        server = subprocess.Popen(argv)
    except FileNotFoundError:
        raise OrchError(
            f"`{argv[0]}` is not on PATH on the vLLM node; the recipe's setup must install '.[vllm]'"
        ) from None
    seen_open, closed = False, 0
    try:
        while server.poll() is None:
            time.sleep(poll)
            if _port_open(head_ip, head_port):
                seen_open, closed = True, 0
            elif seen_open:
                closed += 1
                if closed >= grace:
                    print("[orch] the trainers finished: stopping the vLLM server", flush=True)
                    server.terminate()
                    try:
                        server.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        server.kill()
                    return 0
        print(f"[orch] the vLLM server exited with code {server.returncode}", flush=True)
        return server.returncode or 1
    finally:
        if server.poll() is None:
            server.kill()
