"""A barrier every node passes before it starts accelerate: a node that never joins is named, not waited on.

torchrun's static rendezvous waits for a missing node silently and then fails without saying which one.
Here the head node listens on ORCH_BARRIER_PORT (default MAIN_PROCESS_PORT + 1); every other node connects
and sends its rank; once all ranks are in, the head answers `go` and everyone execs accelerate. Past the
timeout (ORCH_RENDEZVOUS_TIMEOUT seconds, default 600) the head names the ranks that never came, and a worker
that cannot reach the head says so.
"""

from __future__ import annotations

import socket
import time

from orchestrator.core.errors import OrchError, RetryableError

DEFAULT_TIMEOUT = 600.0


def head_wait(nodes: int, port: int, timeout: float) -> float:
    """On rank 0: wait for ranks 1..nodes-1. Returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    joined: dict[int, socket.socket] = {}
    try:
        if socket.has_dualstack_ipv6():  # one socket for IPv4 and IPv6 heads alike
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError as exc:
        raise OrchError(
            f"the head node cannot listen on barrier port {port} ({exc.strerror}); set ORCH_BARRIER_PORT to a free port"
        ) from None
    server.settimeout(0.5)
    try:
        while len(joined) < nodes - 1:
            if time.monotonic() > deadline:
                missing = [r for r in range(1, nodes) if r not in joined]
                raise RetryableError(
                    f"node(s) {', '.join(map(str, missing))} never joined the head within {timeout:g} s; check "
                    "their setup logs and that the nodes reach each other "
                    "(raise ORCH_RENDEZVOUS_TIMEOUT to wait longer)"
                )
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(10)
            try:
                line = conn.makefile("r").readline().strip()
                rank = int(line)
            except (OSError, ValueError):
                conn.close()
                continue
            if 0 < rank < nodes:
                joined[rank] = conn
            else:
                conn.close()
        for conn in joined.values():
            conn.sendall(b"go\n")
        return time.monotonic() - started
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


WORKER_GRACE = 15.0
"""Seconds (at most the timeout itself) a worker waits past the timeout: the head, which knows which nodes never
came, speaks first."""


def worker_join(rank: int, head_ip: str, port: int, timeout: float) -> float:
    """On rank > 0: report to the head and wait for its `go`."""
    started = time.monotonic()
    grace = min(WORKER_GRACE, timeout)
    deadline = started + timeout + grace
    while True:
        try:
            conn = socket.create_connection((head_ip, port), timeout=3)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RetryableError(
                    f"node {rank} could not reach the head node {head_ip}:{port} within {timeout + grace:g} s "
                    f"(ORCH_RENDEZVOUS_TIMEOUT={timeout:g}, and {grace:g} s for the head to speak first); check "
                    "that the head is up and the nodes reach each other (raise ORCH_RENDEZVOUS_TIMEOUT to wait longer)"
                ) from None
            time.sleep(0.5)
    with conn:
        conn.sendall(f"{rank}\n".encode())
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            reply = conn.makefile("r").readline().strip()
        except OSError:
            reply = ""
    if reply != "go":
        raise RetryableError(
            f"node {rank} joined the head {head_ip}:{port} but was not released: another node never joined "
            "(the head's log names it)"
        )
    return time.monotonic() - started
