"""Node side: TRL's vLLM server on the last node of a GRPO run (VLLM_SERVER_NODES=1).

The other nodes train with `--vllm_server_host <last node's IP>`; the server node runs `trl vllm-serve`
(data-parallel over its GPUs unless VLLM_TENSOR_PARALLEL_SIZE says) until the trainers' rendezvous on the head
node has opened and then closed, so that the SkyPilot job completes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orchestrator.core import trainers, vllm_fit
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import env_port, knob
from orchestrator.core.overrides import truthy
from orchestrator.core.topology import Topology

DEFAULT_PORT = 8000


def server_nodes(env: Mapping[str, str], cluster: Topology, trainer: str) -> int:
    """How many nodes at the end of the cluster serve generations instead of training (0 or 1)."""
    raw = env.get("VLLM_SERVER_NODES", "").strip() or "0"
    if raw not in ("0", "1"):
        raise OrchError(f"VLLM_SERVER_NODES={raw!r}: orch runs TRL's vLLM server on 0 or 1 node (the last one)")
    if raw == "1" and cluster.nodes < 2:
        raise OrchError("VLLM_SERVER_NODES=1 needs at least 2 nodes (one trains, the last serves): pass --nodes 2")
    if raw == "1" and not trainers.spec(trainer).generates:
        generating = ", ".join(name for name, spec in trainers.SPECS.items() if spec.generates)
        raise OrchError(
            f"VLLM_SERVER_NODES=1 serves generations for {generating}; TRL_TRAINER is {trainer}: set "
            "VLLM_SERVER_NODES: 0"
        )
    return int(raw)


def check_mode(serving: int, settings: Mapping, trainer: str) -> None:
    """The trainers' vllm_mode against the server node: `server` with none to reach would have every trainer wait for
    TRL's client timeout (vllm_server_timeout, 240 s) on paid GPUs; a server node the trainers do not use serves
    nobody."""
    if not trainers.spec(trainer).generates:
        return
    used = truthy(settings.get("use_vllm", False))  # as core/fit.py reads it (TRL takes 1, yes, true)
    mode = str(settings.get("vllm_mode") or "colocate").strip()
    named = settings.get("vllm_server_base_url") or str(settings.get("vllm_server_host") or "0.0.0.0") != "0.0.0.0"
    if used and mode == "server" and not serving and not named:
        raise OrchError(
            "vllm_mode=server and no vLLM server to reach: VLLM_SERVER_NODES=1 runs one on the last node (as "
            "qwen25_grpo_vllm_server does), vllm_server_base_url names one of yours, or use vllm_mode=colocate"
        )
    if serving and not (used and mode == "server"):
        why = "use_vllm is off" if not used else f"vllm_mode={mode}"
        raise OrchError(f"VLLM_SERVER_NODES={serving} runs a vLLM server the trainers would not use ({why}): set "
                        "use_vllm=true vllm_mode=server, or VLLM_SERVER_NODES: 0")  # fmt: skip


def server_argv(env: Mapping[str, str], settings: Mapping, gpus: int) -> list[str]:
    """`trl vllm-serve` for the last node."""
    model = settings.get("model_name_or_path")
    if not model:
        raise OrchError("the TRL config names no model_name_or_path for the vLLM server")
    tp = vllm_fit.tensor_parallel(env, gpus)
    return [
        "trl", "vllm-serve", "--model", str(model),
        "--tensor_parallel_size", str(tp), "--data_parallel_size", str(gpus // tp),
        "--host", "0.0.0.0", "--port", env_port(env, "VLLM_SERVER_PORT", DEFAULT_PORT),
    ]  # fmt: skip


def trainer_arguments(env: Mapping[str, str], cluster: Topology) -> list[str]:
    """What the training nodes' TRL script needs to reach the server (the last node)."""
    return ["--vllm_server_host", cluster.node_ips[-1], "--vllm_server_port", env_port(env, "VLLM_SERVER_PORT", 8000)]


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
    poll = knob(env, "ORCH_VLLM_POLL_SECONDS", 10.0)
    grace = knob(env, "ORCH_VLLM_CLOSED_POLLS", 3)
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
