"""A real Slurm cluster on this machine for the tests: Debian's slurm-wlm with munge, slurmctld in one
network namespace and one slurmd per emulated node in namespaces of their own (orch's --netns namespaces, each with
its own address and host name on a bridge), each slurmd with its own spool directory. Root only.

    with SlurmCluster(nodes=2, root=tmp_path) as cluster:
        cluster.run("sbatch", ...)      # Slurm's commands, from the controller's namespace
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from orchestrator.launch.backends.netns import Network

# openssh-server and rsync: tests/sky_bed.py's login node; rclone and fuse3: the bucket mount SkyPilot makes with
# MOUNT_CACHED, for real (tests/test_disk.py)
PACKAGES = ("slurm-wlm", "munge", "openssh-server", "rsync", "rclone", "fuse3")


INSTALLING: list[subprocess.Popen] = []  # apt-get, started in the background when the session collects Slurm tests


def start_install() -> None:
    """Install the packages in the background (conftest calls it once the Slurm tests are collected), so that apt's
    minute overlaps the tests that run before them. Under pytest-xdist every worker collects the Slurm tests and
    calls this: flock lets one install while the others wait for it, then find the packages there."""
    if os.geteuid() != 0 or _installed() or not shutil.which("apt-get"):
        return
    script = (
        "command -v slurmctld >/dev/null && command -v munged >/dev/null && [ -x /usr/sbin/sshd ] && "
        "command -v rsync >/dev/null && command -v rclone >/dev/null && command -v fusermount3 >/dev/null || "
        f"{{ apt-get update -qq && apt-get install -y -qq --no-install-recommends {' '.join(PACKAGES)}; }}"
    )
    INSTALLING.append(subprocess.Popen(["flock", "/var/lock/orch-test-slurm-install", "bash", "-c", script],
                                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip


def _installed() -> bool:
    return bool(shutil.which("slurmctld") and shutil.which("munged") and Path("/usr/sbin/sshd").exists()
                and shutil.which("rsync") and shutil.which("rclone") and shutil.which("fusermount3"))  # fmt: skip


def missing() -> str:
    """Why a Slurm cluster cannot be made here ("" when it can, after installing the packages if needed). As root
    with apt-get, a failed install is an error, not a reason to skip: CI runs these tests as root."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, munged, slurmd)"
    if not shutil.which("ip"):
        return "needs iproute2's ip"
    if not INSTALLING:
        start_install()
    for proc in INSTALLING:
        output = proc.communicate(timeout=900)[0] if proc.returncode is None else ""
        if proc.returncode != 0:
            raise RuntimeError(f"installing {' and '.join(PACKAGES)} failed: {(output or '').strip()[-300:]}")
    if _installed():
        return ""
    return f"{', '.join(PACKAGES)} are not installed and there is no apt-get to install them"


CONF = """\
ClusterName=orchtest
SlurmctldHost={controller}({controller_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
KillWait=10
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def started(bed):
    """`bed._start()`, and `bed.close()` if it fails partway: whatever came up goes down again."""
    try:
        bed._start()
    except BaseException:
        bed.close()
        raise
    return bed


class SlurmCluster:
    def __init__(self, nodes: int, root: Path, node_prefix=None, cpus: int = 1):
        """node_prefix(i): words that run before node i's slurmd inside its namespace (tests/sky_bed.py mounts each
        node's own scratch directory there)."""
        self.nodes = nodes
        self.root = root
        self.node_prefix = node_prefix or (lambda node: [])
        self.cpus = cpus  # what each node offers Slurm (SkyPilot's smallest default asks for 2)
        self.conf = root / "slurm.conf"
        self.network = Network(nodes + 1)  # namespace 0: slurmctld; 1..nodes: one slurmd each
        self.daemons: list[subprocess.Popen] = []
        self.munged: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def names(self) -> list[str]:
        return [f"orch-node{i}" for i in range(1, self.nodes + 1)]

    def __enter__(self) -> SlurmCluster:
        self.network.__enter__()
        return started(self)

    def _start(self) -> None:
        ips = self.network.ips
        for sub in ("state", *(f"spool/{name}" for name in self.names())):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        lines = "\n".join(f"NodeName={name} NodeAddr={ip} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
                          for name, ip in zip(self.names(), ips[1:], strict=True))  # fmt: skip
        # slurmctld checks that it runs on SlurmctldHost: this machine's name (namespaces share it)
        controller = socket.gethostname().split(".")[0]
        self.conf.write_text(CONF.format(controller=controller, controller_ip=ips[0], root=self.root, nodes=lines))
        socket_dir = self.root / "munge"
        socket_dir.mkdir(exist_ok=True)
        self.munge_socket = socket_dir / "munge.socket"
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:  # none answering (a stale socket too)
            # one munged serves every namespace (a Unix socket)
            Path("/run/munge/munge.socket.2").unlink(missing_ok=True)
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            self.munged = subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "--foreground"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            self._wait(lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, "munged")
        self.daemons.append(self._daemon(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
        for i in range(1, self.nodes + 1):
            self.daemons.append(self._slurmd(i))
        self._wait(self._idle, f"{self.nodes} idle node(s) in `sinfo`", timeout=60)

    def _daemon(self, ns: int, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen([*self.network.prefix(ns), *argv], env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip

    def _slurmd(self, node: int) -> subprocess.Popen:
        """Node `node`'s slurmd (1..nodes), in its namespace."""
        name = self.names()[node - 1]
        return self._daemon(node, [*self.node_prefix(node), "slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def _idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        return sum(1 for line in out if line.split()[1:] == ["idle"]) == self.nodes

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({proc.args}): {self.logs()}")
            time.sleep(0.5)
        raise RuntimeError(f"no {what} after {timeout:g} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("slurm*.log")))

    def run(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        """A Slurm command (sbatch, squeue, scancel...) from the controller's namespace."""
        return subprocess.run([*self.network.prefix(0), *argv], env={**self.env, **kw.pop("env", {})},
                              capture_output=True, text=True, timeout=kw.pop("timeout", 60), **kw)  # fmt: skip

    def __exit__(self, *exc) -> None:
        self.close()

    def crash(self, node: int) -> None:
        """Node `node` (1..nodes) fails as a machine does: every process in its namespace (slurmd, job steps, what
        they run) killed at once; then it is marked DOWN, as a cluster's health check does (Slurm itself would after
        SlurmdTimeout, 60 s here), which ends its jobs (NODE_FAIL). `restart(node)` brings its slurmd back."""
        self._kill_stragglers([self.network.namespaces[node]])
        self.daemons[node].wait(timeout=15)
        down = self.run("scontrol", "update", f"nodename={self.names()[node - 1]}", "state=down", "reason=crashed")
        if down.returncode != 0:
            raise RuntimeError(f"scontrol could not mark node {node} down: {down.stderr}")

    def restart(self, node: int) -> None:
        """Node `node`'s slurmd again: it registers, and ReturnToService=2 puts the node back in service."""
        self.daemons[node] = self._slurmd(node)

    def _kill_stragglers(self, namespaces: list[str] | None = None) -> None:
        """Every process still inside one of the cluster's namespaces (a step's slurmstepd that outlived its slurmd,
        what it ran): found by network namespace, killed by PID, until none is left."""
        mine = set()
        for ns in self.network.namespaces if namespaces is None else namespaces:
            try:
                mine.add(os.stat(f"/run/netns/{ns}").st_ino)
            except FileNotFoundError:
                continue
        deadline = time.monotonic() + 20
        while mine and time.monotonic() < deadline:
            left = []
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in mine:
                        left.append(int(entry))
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def close(self) -> None:
        # A job left running (a failed test, a SkyPilot cluster not taken down) is cancelled first: its slurmstepd
        # processes would outlive slurmd, reparented to init.
        if self.daemons and all(proc.poll() is None for proc in self.daemons):
            jobs = self.run("squeue", "-h", "-o", "%i", timeout=30).stdout.split()
            if jobs:
                self.run("scancel", *jobs, timeout=30)
                deadline = time.monotonic() + 20
                while self.run("squeue", "-h", timeout=30).stdout.strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for proc in reversed(self.daemons):
            proc.terminate()
        for proc in self.daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.munged is not None:
            self.munged.terminate()
            self.munged.wait(timeout=15)
        self._kill_stragglers()
        self.network.close()
