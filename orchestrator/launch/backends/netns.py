"""`orch run --local --netns`: each emulated node in a Linux network namespace of its own, with its own address on a
virtual bridge, so the head address, the ports, orch's barrier and gloo travel a real (virtual) network and a node
can be cut off (`cut`) or never come up. Root only (CAP_NET_ADMIN); plain `--local` shares 127.0.0.1.

Layout for run owner pid P and N nodes: bridge `obP`, namespaces `orch-P-n<i>`, veth pairs `oP-<i>` (bridge side)
and `onode` (inside namespace i, address 10.213.S.<i+1>/24, S a /24 no interface of this host uses). Made with
iproute2's `ip` (what the kernel's own tools offer; no library needed) and removed on exit, also when the run fails;
leftovers of an owner that was killed are removed by the next `--netns` run (`sweep`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from orchestrator.core.errors import OrchError

IFACE = "onode"  # the node's interface inside its namespace (gloo binds to it: GLOO_SOCKET_IFNAME)
MAX_NODES = 250


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise OrchError(f"--netns: `ip {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}")
    return out


def available() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "--netns needs root (it creates network namespaces); run as root or drop --netns"
    if not shutil.which("ip"):
        return "--netns needs iproute2's `ip` (apt-get install iproute2)"
    return ""


def _free_subnet() -> int:
    used = set(re.findall(r"inet 10\.213\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout))
    for ns in _ip("netns", "list").stdout.split():
        if ns.startswith("orch-"):
            used |= set(
                re.findall(r"inet 10\.213\.(\d+)\.", _ip("-n", ns, "-4", "-o", "addr", "show", check=False).stdout)
            )
    for third in range(1, 255):
        if str(third) not in used:
            return third
    raise OrchError("--netns: every 10.213.x.0/24 subnet is in use; remove stale `orch-*` namespaces (ip netns del)")


def sweep() -> list[str]:
    """Remove the namespaces and bridges of owners that are gone; return what was removed."""
    removed = []
    for name in _ip("netns", "list").stdout.split():
        match = re.fullmatch(r"orch-(\d+)-n\d+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    for match in re.finditer(r"^\d+: (ob(\d+))[:@]", _ip("-o", "link", "show", "type", "bridge").stdout, re.M):
        if not os.path.exists(f"/proc/{match.group(2)}"):
            _ip("link", "del", match.group(1), check=False)
            removed.append(match.group(1))
    return removed


class Network:
    def __init__(self, nodes: int, owner: int | None = None):
        if nodes > MAX_NODES:
            raise OrchError(f"--netns: at most {MAX_NODES} nodes (one /24 subnet)")
        self.owner = owner or os.getpid()
        self.nodes = nodes
        self.bridge = f"ob{self.owner}"
        self.namespaces = [f"orch-{self.owner}-n{i}" for i in range(nodes)]
        self.links = [f"o{self.owner}-{i}" for i in range(nodes)]
        self.ips: list[str] = []

    def __enter__(self) -> Network:
        why = available()
        if why:
            raise OrchError(why)
        sweep()
        subnet = _free_subnet()
        self.ips = [f"10.213.{subnet}.{i + 1}" for i in range(self.nodes)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for ns, link, ip in zip(self.namespaces, self.links, self.ips, strict=True):
                _ip("netns", "add", ns)
                _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
                _ip("link", "set", f"{link}p", "netns", ns)
                _ip("-n", ns, "link", "set", f"{link}p", "name", IFACE)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", IFACE)
                _ip("-n", ns, "link", "set", IFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", link, "master", self.bridge, "up")
            self._hosts()
        except BaseException:
            self.close()
            raise
        return self

    def _hosts(self) -> None:
        """/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts: the nodes' addresses resolve both
        ways (torch's c10d looks up its peers' names and waits on DNS otherwise)."""
        import socket

        lines = "127.0.0.1 localhost\n" + "".join(f"{ip} orch-node{i}\n" for i, ip in enumerate(self.ips))
        for ns, ip in zip(self.namespaces, self.ips, strict=True):
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as fh:
                fh.write(lines + f"{ip} {socket.gethostname()}\n")  # this node's own name, as on a real node

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # its end of the veth pair goes with it, and the pair
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for link in self.links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def prefix(self, node: int) -> list[str]:
        """What runs node `node`'s command inside its namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def cut(self, node: int) -> None:
        """Take node `node`'s link down: its packets go nowhere, as with a dead NIC or a partition."""
        _ip("link", "set", self.links[node], "down")
