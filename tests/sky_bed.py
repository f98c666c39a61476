"""Real SkyPilot on a local Slurm cluster: SkyPilot's own API server and Slurm provisioner against
tests/slurm_cluster.py's cluster, offline. Root only.

    with SkyBed(root) as bed:
        bed.sky("launch", "-c", "c1", "--infra", f"slurm/{bed.name}", "task.yaml", "-y")

What the bed adds to the Slurm cluster (../shared/skypilot-on-slurm.md has the measurements behind each):
- a login node: sshd in the controller's namespace, a user of its own (SkyPilot logs in as a user and runs sbatch and
  srun there; its home, under the bed, is seen by every node as on a shared file system);
- an isolated client home for SkyPilot (HOME=<bed>/client: ~/.slurm/config naming the login node) and SkyPilot's
  local API server, started and stopped by the bed;
- as on a real cluster, every node has a /tmp of its own (bind-mounted inside its mount namespace: SkyPilot keeps its
  runtime and each node's setup script there) and shares the home directories (the bed lives under /var/tmp);
- SHIMS, offline stand-ins for what SkyPilot fetches from the internet, in the login user's PATH only; each names the
  SkyPilot line it answers, and tests/test_sky_bed.py fails, naming the shim, when a SkyPilot upgrade moves that line;
- managed=True (the suite's bed, `make sky-bed`): SkyPilot's jobs controller inside its API server, which then runs in
  the login node's namespace where its network check is answered (tests/bed_network.py).
"""

from __future__ import annotations

import atexit
import os
import pwd
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_cluster import SlurmCluster, start_install, started

USER = "orchsky"
BED_HOMES = "/var/tmp/orch-skybed"  # beds live under paths starting with this (not /tmp: each node has its own)
CACHE = Path("/var/tmp/orch-skybed-cache")  # kept between beds: the user's uv cache, filled once per version
# What the test session sets for itself and a cluster's client would not have: the local API server switch, and the
# session's own SkyPilot state (tests/conftest.py); the client keeps its state in its own home.
BED_DROPS = ("SKYPILOT_DISABLE_LOCAL_API_SERVER", "SKY_RUNTIME_DIR")
NAME = "orchbed"
API_PORT = 46580  # SkyPilot's local API server (sky/server/common.py DEFAULT_SERVER_PORT); the managed bed relays it
UV_INSTALLER = "https://astral.sh/uv/install.sh"

# Offline shims: (what SkyPilot runs, where: module and the text the shim answers). A test reads the module's source
# and fails naming the shim when the text is gone.
SHIMS = {
    "curl": ("sky.skylet.constants", "curl -LsSf https://astral.sh/uv/install.sh"),
    "uv": ("sky.skylet.constants", "venv --seed {SKY_REMOTE_PYTHON_ENV} --python 3.10"),
    "uv cache": ("sky.utils.command_runner", "export UV_CACHE_DIR=/tmp/uv_cache_$(id -u)"),
    # not a shim but the bed's shape: SkyPilot writes each node's setup script to one /tmp path, so nodes need their own
    "node-local /tmp": ("sky.backends.cloud_vm_ray_backend", "remote_setup_file_name = f'/tmp/sky_setup_"),
    # the managed bed only (tests/bed_network.py): HTTPS answered at these addresses for the API server
    "network check": ("sky.backends.backend_utils", "_TEST_IP_LIST = ['https://8.8.8.8', 'https://1.1.1.1']"),
    "network check loop": ("sky.jobs.controller", "await backend_utils.async_check_network_connection()"),
}
CURL = """#!/bin/bash
# Offline shim (tests/sky_bed.py SHIMS["curl"]): SkyPilot installs uv with `curl -LsSf {url} | sh`
# (sky/skylet/constants.py SKY_UV_INSTALL_CMD). Answer that URL with a script that installs the bed's uv wrapper.
for arg in "$@"; do
  if [ "$arg" = "{url}" ]; then
    dir='${{UV_INSTALL_DIR:-$HOME/.local/bin}}'
    printf '%s\\n' "mkdir -p \"$dir\" && cp {shims}/uv \"$dir/uv\""
    exit 0
  fi
done
exec /usr/bin/curl "$@"
"""
UV = """#!/bin/bash
# Offline shim (tests/sky_bed.py SHIMS["uv"]): SkyPilot makes its runtime with `uv venv --seed ... --python 3.10`
# (sky/skylet/constants.py UV_INSTALLATION_COMMANDS); there is no 3.10 here and uv would download one. Use 3.11.
args=()
prev=
for arg in "$@"; do
  if [ "$prev" = "--python" ] && [ "$arg" = "3.10" ]; then arg={python}; fi
  args+=("$arg"); prev=$arg
done
exec {uv} "${{args[@]}}"
"""
SSHD = """\
ListenAddress {ip}
Port 22
HostKey {root}/ssh/host_key
PidFile {root}/ssh/sshd.pid
AuthorizedKeysFile {root}/ssh/authorized_keys
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
StrictModes no
AllowUsers {user}
MaxSessions 200
MaxStartups 200
SetEnv SLURM_CONF={conf}
Subsystem sftp internal-sftp
"""


def missing() -> str:
    """Why the bed cannot be made here ("" when it can: as root, tests/slurm_cluster.py installs Slurm, munge, sshd
    and rsync from Debian's packages)."""
    from slurm_cluster import missing as slurm_missing

    return slurm_missing()


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end this process as Ctrl-C does, through its `with` blocks and `finally`s: a bed that a
    terminal's close or a `kill` stops still takes its processes, namespaces, users, mounts and directory down (Python's
    default for both ends the process at once, leaving all of them)."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


def installed_or_why() -> str:
    """Outside pytest (`make sky-bed`, `make bench`): Slurm's packages installed now, waited for, then `missing()`."""
    from slurm_cluster import INSTALLING

    start_install()
    for proc in INSTALLING:
        proc.wait()
    return missing()


# what a copy of the repository leaves out (the runs' records go to the copy's sky_jobs/, not the checkout's)
REPO_COPY_IGNORE = (".venv", ".git", "outputs", "sky_jobs", "__pycache__", ".mypy_cache", "*.egg-info", "build")


class SkyBed:
    def __init__(self, root: Path, nodes: int = 2, name: str = NAME, managed: bool = False,
                 visible: tuple[Path, ...] | None = ()):  # fmt: skip
        self.root = root
        self.managed = managed  # SkyPilot's jobs controller inside its API server (consolidation mode): `--managed`
        self.name = name
        self.nodes = nodes
        self.client = root / "client"  # SkyPilot's home on the laptop side
        self.home = root / "home" / USER
        self.shims = root / "shims"
        self.temporary = root / "client-tmp"  # the client's TMPDIR: the API server's and the CLI's temporary files
        # the API server's /tmp (`_own_mounts`) and what of the machine's /tmp it sees there: this environment, the
        # repository and the directories whose paths the client hands it (a task's workdir and file mounts); None: the
        # machine's /tmp (`make sky-bed`: a person's --data file may lie anywhere, as with SkyPilot on a laptop)
        self.server_tmp = root / "server-tmp"
        here = (Path(sys.prefix), Path(__file__).resolve().parent.parent, Path.cwd())
        self.visible = None if visible is None else (*here, *visible)
        self.cluster = SlurmCluster(nodes=nodes, root=root / "slurm", node_prefix=self._node_prefix, cpus=2)
        self.sshd: subprocess.Popen | None = None
        self.helpers: list[subprocess.Popen] = []  # the managed bed's network-check responder and API server relay
        # SkyPilot's user hash for the bed's client and API server (~/.sky/user_hash in the client's home, and
        # SKYPILOT_USER_ID over one a person may have set): one of its own, so that what SkyPilot keeps under it in the
        # machine's /tmp is the bed's to remove, not the machine user's (sky/utils/command_runner.py _ssh_control_path:
        # /tmp/sky_ssh_<user hash>/, the ssh control sockets of the client's own calls, e.g. orch's plan reading the
        # Slurm nodes' memory); 8 hex digits, the shape SkyPilot generates (clusters are named <name>-<hash>)
        self.user_hash = secrets.token_hex(4)

    # ------------------------------------------------------------ up

    def __enter__(self) -> SkyBed:
        return started(self)

    @property
    def uv_cache(self) -> Path:
        """The login user's uv cache, shared by the nodes at the path SkyPilot's Slurm runner sets (SHIMS["uv cache"]:
        /tmp/uv_cache_<uid>, bind-mounted into each node's own /tmp)."""
        return CACHE / f"uv_cache_{self.uid}"

    def _node_prefix(self, node: int) -> list[str]:
        """Each slurmd in its namespace with a /tmp of its own, and the shared uv cache inside it."""
        own = self.root / "tmp" / f"node{node}"
        own.mkdir(parents=True, exist_ok=True)
        own.chmod(0o1777)
        cache = f"/tmp/uv_cache_{self.uid}"
        script = f'mount --bind {own} /tmp && mkdir -p {cache} && mount --bind {self.uv_cache} {cache} && exec "$@"'
        return ["bash", "-c", script, "bed"]

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.temporary.mkdir(exist_ok=True)
        self._user()
        self.uv_cache.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.uv_cache, USER, USER)
        self.cluster.__enter__()
        login_ip = self.cluster.network.ips[0]
        # the client (this namespace) reaches the login node over the bridge
        subnet = login_ip.rsplit(".", 1)[0]
        subprocess.run(["ip", "addr", "add", f"{subnet}.254/24", "dev", self.cluster.network.bridge], check=True)
        self._shims()
        self._sshd(login_ip)
        self._client(login_ip)
        self._warm_uv_cache()
        self._api_server()

    def _user(self) -> None:
        try:
            home = pwd.getpwnam(USER).pw_dir
        except KeyError:
            home = None
        if home is not None and not home.startswith(BED_HOMES):
            raise RuntimeError(f"a user {USER} exists on this machine (home {home}): the bed will not take it over")
        if home is not None:  # left by a bed that was killed
            subprocess.run(["userdel", USER], check=True)
        self.home.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["useradd", "-m", "-d", str(self.home), "-s", "/bin/bash", USER], check=True)
        subprocess.run(["usermod", "-p", "*", USER], check=True)  # no password, but not locked: sshd lets it in
        self.home.mkdir(parents=True, exist_ok=True)
        self.uid = pwd.getpwnam(USER).pw_uid
        shutil.chown(self.home, USER, USER)

    def _shims(self) -> None:
        self.shims.mkdir(exist_ok=True)
        uv = self.shims / "uv-real"
        shutil.copy2(Path(sys.executable).parent / "uv", uv)
        python = "/usr/bin/python3.11" if Path("/usr/bin/python3.11").exists() else "/usr/bin/python3"  # the image's
        (self.shims / "uv").write_text(UV.format(python=python, uv=uv))
        (self.shims / "curl").write_text(CURL.format(url=UV_INSTALLER, shims=self.shims))
        for path in self.shims.iterdir():
            path.chmod(0o755)
        profile = (
            f'export PATH="{self.shims}:$PATH"\n'  # after Debian's /etc/profile, which resets PATH
            f"export SLURM_CONF={self.cluster.conf}\n"
            "export UV_OFFLINE=1\n"
        )
        (self.home / ".profile").write_text(profile)
        (self.home / ".bashrc").write_text(profile)
        shutil.chown(self.home / ".profile", USER, USER)
        shutil.chown(self.home / ".bashrc", USER, USER)

    def _sshd(self, ip: str) -> None:
        ssh = self.root / "ssh"
        ssh.mkdir(exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "host_key")], check=True)
        (self.client / ".ssh").mkdir(parents=True, exist_ok=True)
        key = self.client / ".ssh" / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        (ssh / "authorized_keys").write_text((self.client / ".ssh" / "id_ed25519.pub").read_text())
        (ssh / "authorized_keys").chmod(0o644)
        config = ssh / "sshd_config"
        config.write_text(SSHD.format(ip=ip, root=self.root, user=USER, conf=self.cluster.conf))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.sshd = subprocess.Popen([*self.cluster.network.prefix(0), "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=open(ssh / "sshd.log", "w"))  # fmt: skip
        deadline = time.monotonic() + 20
        while self.ssh("true").returncode != 0:
            if time.monotonic() > deadline or self.sshd.poll() is not None:
                raise RuntimeError(f"sshd on the login node did not answer: {(ssh / 'sshd.log').read_text()[-800:]}")
            time.sleep(0.3)

    def ssh(self, command: str) -> subprocess.CompletedProcess:
        """A command on the login node as the bed's user (what SkyPilot's Slurm runner does)."""
        key = self.client / ".ssh" / "id_ed25519"
        return subprocess.run(["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o",
                               "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                               f"{USER}@{self.cluster.network.ips[0]}", command],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    def _client(self, ip: str) -> None:
        (self.client / ".slurm").mkdir(parents=True, exist_ok=True)
        (self.client / ".slurm" / "config").write_text(
            f"Host {self.name}\n  HostName {ip}\n  User {USER}\n  IdentityFile {self.client}/.ssh/id_ed25519\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
        )
        (self.client / ".sky").mkdir(exist_ok=True)
        (self.client / ".sky" / "user_hash").write_text(self.user_hash)
        if self.managed:  # sky/jobs/utils.py setup_consolidation_mode_on_startup reads it when the API server starts
            (self.client / ".sky" / "config.yaml").write_text("jobs:\n  controller:\n    consolidation_mode: true\n")

    @property
    def env(self) -> dict[str, str]:
        """The environment the SkyPilot client (sky CLI, the SDK, orch) runs with."""
        env = {k: v for k, v in os.environ.items() if k not in BED_DROPS}
        # TMPDIR in the bed: the API server's workers, killed when it stops, leave their sky-tmp* directories there
        return {**env, "HOME": str(self.client), "TMPDIR": str(self.temporary), "SKYPILOT_USER_ID": self.user_hash,
                "SKYPILOT_DEBUG": env.get("SKYPILOT_DEBUG", "0")}  # fmt: skip

    @property
    def ssh_controls(self) -> Path:
        """Where SkyPilot's ssh keeps its control sockets for the bed's clients (and for its API server under
        `make sky-bed`, which shares the machine's /tmp): the bed's own user hash makes it the bed's."""
        return Path("/tmp") / f"sky_ssh_{self.user_hash}"

    def _warm_uv_cache(self) -> None:
        """SkyPilot installs its runtime on the nodes with uv from PyPI (sky/skylet/constants.py); the nodes have no
        route out. Fill the login user's uv cache (the path SkyPilot's Slurm runner sets, SHIMS["uv cache"]) once,
        from this namespace, by installing the same wheel into a scratch environment."""
        cache = self.uv_cache
        stamp = cache / f".orch-bed-sky-{self._sky_version()}"
        if stamp.exists():
            return
        work = self.root / "warm"
        work.mkdir(exist_ok=True)
        shutil.chown(work, USER, USER)
        wheel = str(shutil.copy(self._sky_wheel(), work))
        os.chmod(wheel, 0o644)
        script = (
            f"set -e; export UV_CACHE_DIR={cache}; {self.shims}/uv venv -q --seed {work}/venv --python 3.10; "
            f"VIRTUAL_ENV={work}/venv {self.shims}/uv pip install -q '{wheel}[slurm,remote]'"
        )
        # cwd: uv reads a uv.toml in its working directory, and the login user may not traverse the checkout's
        # parents (a clone under `mktemp -d`, mode 0700, failed with "failed to open file .../uv.toml")
        done = subprocess.run(["runuser", "-u", USER, "--", "bash", "-c", script], capture_output=True, text=True,
                              timeout=600, cwd=work)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"warming the uv cache failed: {done.stderr[-1500:]}")
        stamp.touch()

    def _sky_wheel(self) -> Path:
        """SkyPilot's wheel for the nodes, built as its API server builds it (sky/backends/wheel_utils.py: reused from
        the client's ~/.sky/wheels while newer than SkyPilot's files), from this namespace: the build fetches setuptools
        from the package registry. Kept between beds in CACHE (copied with its times) under the newest time of the
        installed package's files, SkyPilot's own test: a copy older than them would be rebuilt on the first launch (a
        rebuild into an existing directory keeps its old time), which the login node's namespace cannot do."""
        import sky

        newest = 0.0
        for package in (Path(sky.__file__).parent, Path(sky.__file__).parent.parent / "sky_templates"):
            for top, dirs, files in os.walk(package):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for entry in (*dirs, *(f for f in files if not f.endswith(".pyc"))):
                    newest = max(newest, os.path.getmtime(os.path.join(top, entry)))
        kept = CACHE / f"sky-wheels-{self._sky_version()}-{int(newest)}"
        wheels = self.client / ".sky" / "wheels"
        if kept.is_dir() and not wheels.exists():
            wheels.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-a", str(kept), str(wheels)], check=True)
        build = (
            "from sky.backends import wheel_utils; path, _ = wheel_utils.build_sky_wheel(); "
            "print(sorted(path.glob('skypilot-*.whl'))[-1])"
        )
        made = Path(subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=300,
                                   env=self.env, check=True).stdout.strip().splitlines()[-1])  # fmt: skip
        wheel = self.root / made.name
        shutil.copy(made, wheel)
        shutil.rmtree(made.parent)  # a temporary copy, the caller's to remove
        if not kept.is_dir():
            part = CACHE / f"{kept.name}.{os.getpid()}"
            subprocess.run(["cp", "-a", str(wheels), str(part)], check=True)
            try:
                os.replace(part, kept)
            except OSError:  # another bed kept it first
                shutil.rmtree(part, ignore_errors=True)
            for stale in CACHE.glob("sky-wheels-*"):  # other installations' (another clone, another version)
                if stale != kept:
                    shutil.rmtree(stale, ignore_errors=True)
        return wheel

    def orch_image(self) -> Path:
        """An environment holding the lock's torch (the CPU build on this machine's disk), as a GPU image holds its
        CUDA torch, owned by the bed's user: node-setup.sh keeps its torch (ORCH_VENV) and installs the rest of
        uv.lock into it, offline, from the user's uv cache, filled here from this machine's (what `make install`
        downloaded)."""
        image = self.root / "images" / "orch"  # its parent is the user's too: node-setup.sh locks ORCH_VENV.lock there
        if not (image / "bin" / "python").exists():
            image.parent.mkdir(exist_ok=True)
            shutil.chown(image.parent, USER, USER)
            uv = str(self.shims / "uv-real")
            subprocess.run([uv, "venv", "-q", "--seed", "--python", "/usr/bin/python3.11", str(image)], check=True)
            subprocess.run(["chown", "-R", f"{USER}:{USER}", str(image)], check=True)
            torch = self._locked("torch")
            if not link_installed("torch", torch, image):  # this environment's torch is another: the wheel on disk
                subprocess.run([str(image / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={torch}"],
                               check=True, capture_output=True, timeout=900)  # fmt: skip
                subprocess.run(["chown", "-R", f"{USER}:{USER}", str(image)], check=True)
        cache = self.uv_cache
        stamp = cache / f".orch-bed-lock-{self._lock_key()}"
        if not stamp.exists():
            mine = subprocess.run([str(self.shims / "uv-real"), "cache", "dir"], capture_output=True, text=True,
                                  check=True).stdout.strip()  # fmt: skip
            subprocess.run(["cp", "-a", f"{mine}/.", str(cache)], check=True)
            subprocess.run(["chown", "-R", f"{USER}:{USER}", str(cache)], check=True)
            stamp.touch()
        return image

    def _locked(self, package: str) -> str:
        import tomllib

        lock = tomllib.loads((Path(__file__).resolve().parent.parent / "uv.lock").read_text())
        return next(p["version"] for p in lock["package"] if p["name"] == package)

    def _lock_key(self) -> str:
        import hashlib

        return hashlib.sha256((Path(__file__).resolve().parent.parent / "uv.lock").read_bytes()).hexdigest()[:12]

    def _sky_version(self) -> str:
        import importlib.metadata

        return importlib.metadata.version("skypilot")

    def _own_mounts(self) -> list[str]:
        """The prefix that starts the API server in a mount namespace of its own (gone with its last process), with
        - a /dev/shm of its own: its multiprocessing semaphores (/dev/shm/sem.mp-*, ~10 a start) outlived it;
        - a /tmp of its own, the bed's `server-tmp`: SkyPilot writes to literal /tmp paths, which outlived the bed in
          the machine's /tmp: /tmp/jobs_ha_recovery.log and /tmp/pool_ha_recovery.log, appended at every start
          (sky/skylet/constants.py HA_PERSISTENT_RECOVERY_LOG_PATH), /tmp/sky_ssh_<hash>/ for ssh's control sockets
          (sky/utils/command_runner.py), uvicorn's /tmp/skypilot_graceful_shutdown.lock (sky/server/uvicorn.py).
          The machine's directories in `visible` that lie under /tmp are bind-mounted at their own paths in it: the
          local API server reads the client's paths as they are (a workdir is not uploaded)."""
        script = ["mount -t tmpfs -o size=64m,mode=1777 orch-bed-shm /dev/shm"]
        if self.visible is not None:
            self.server_tmp.mkdir(exist_ok=True)
            self.server_tmp.chmod(0o1777)
            tmp = Path("/tmp").resolve()
            under = sorted(p for p in {p.resolve() for p in self.visible} if p != tmp and p.is_relative_to(tmp))
            for path in (p for p in under if not any(p != q and p.is_relative_to(q) for q in under)):
                inside = shlex.quote(str(self.server_tmp / path.relative_to(tmp)))
                script.append(f"mkdir -p {inside} && mount --bind {shlex.quote(str(path))} {inside}")
            script.append(f"mount --rbind {shlex.quote(str(self.server_tmp))} /tmp")
        return ["unshare", "-m", "--propagation", "private", "bash", "-c", " && ".join([*script, 'exec "$@"']), "bed"]

    def _api_server(self) -> None:
        own = self._own_mounts()  # its own /dev/shm and /tmp
        if not self.managed:
            done = self.sky("api", "start", timeout=180, prefix=own)
        else:  # in the login node's namespace, where SkyPilot's network check is answered (tests/bed_network.py)
            import bed_network

            self._sky_wheel()  # the login node's namespace has no route to the package registry
            net = self.root / "network-check"
            cert, key = bed_network.certificate(net)
            login = self.cluster.network
            self.helpers.append(bed_network.responder(login.prefix(0), login.namespaces[0], cert, key,
                                                      net / "responder.log"))  # fmt: skip
            self.helpers.append(bed_network.forwarder(API_PORT, login.ips[0], API_PORT, net / "relay.log"))
            trust = {"SSL_CERT_FILE": str(cert), "REQUESTS_CA_BUNDLE": str(cert)}
            # sized as a 4 GB pod (sky/utils/common_utils.py get_mem_size_gb): one jobs controller, not the 12 this
            # machine's 24 GiB would get, each a process importing SkyPilot (2 GiB in all, and a burst of CPU at the
            # first submission that slowed the suite's other worker)
            small = {"SKYPILOT_POD_MEMORY_GB_LIMIT": "4"}
            done = self.sky("api", "start", "--host", "0.0.0.0", timeout=180, prefix=login.prefix(0) + own,
                            env={**trust, **small})  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sky api start failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")

    def sky(self, *argv: str, timeout: float = 600, prefix: list[str] = (), env: dict | None = None
            ) -> subprocess.CompletedProcess:  # fmt: skip
        """The `sky` CLI of this environment, as a user of the bed runs it."""
        sky = Path(sys.executable).parent / "sky"
        return subprocess.run([*prefix, str(sky), *argv], capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})  # fmt: skip

    # ------------------------------------------------------------ down

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if (self.client / ".sky").exists():
            subprocess.run([str(Path(sys.executable).parent / "sky"), "api", "stop"], env=self.env,
                           capture_output=True, timeout=120)  # fmt: skip
        for helper in self.helpers:
            helper.kill()
            helper.wait(timeout=15)
        if self.sshd is not None:
            self.sshd.terminate()
            self.sshd.wait(timeout=15)
        self.cluster.close()
        deadline = time.monotonic() + 20
        # sshd's sessions, jobs' shells, the API server's own leftovers (its subprocess_daemon.py watchers outlive
        # `sky api stop` by ~30 s, polling for their dead parent) and ssh's control masters: by PID, until gone
        while (
            left := self._user_pids() + self._client_pids() + self._ssh_master_pids()
        ) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        shutil.rmtree(self.ssh_controls, ignore_errors=True)
        try:  # the user, when it is this bed's (its home is here): a user of the machine's own is left alone
            ours = Path(pwd.getpwnam(USER).pw_dir) == self.home
        except KeyError:
            ours = False
        if ours:
            subprocess.run(["userdel", USER], capture_output=True)

    def _client_pids(self) -> list[int]:
        """Live Python processes started with this bed's client environment (HOME=<client>): the API server, its
        workers and their watchers, root's, which `_user_pids` does not see (a person's shell under `make sky-bed`
        is not Python: left alone)."""
        mark = f"\0HOME={self.client}\0".encode()
        python = os.path.realpath(sys.executable)
        return _live_pids(lambda proc: mark in b"\0" + (proc / "environ").read_bytes()
                          and os.path.realpath(proc / "exe") == python)  # fmt: skip

    def _ssh_master_pids(self) -> list[int]:
        """ssh's control masters for the sockets under the bed's own path (ControlPersist 300 s, reparented to init;
        their command line names the socket)."""
        mark = str(self.ssh_controls).encode()
        return _live_pids(lambda proc: mark in (proc / "cmdline").read_bytes())

    def _user_pids(self) -> list[int]:
        """Live processes of the bed's user."""
        uid = getattr(self, "uid", None)
        if uid is None:
            return []
        return _live_pids(lambda proc: proc.stat().st_uid == uid)


def _live_pids(match) -> list[int]:
    """PIDs of the processes other than this one for which `match(Path("/proc/<pid>"))` holds, zombies left out (one
    is already dead and waits for its parent to reap it); a process gone during the walk is skipped."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        proc = Path("/proc") / entry
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and match(proc):
                pids.append(int(entry))
        except (OSError, IndexError):
            continue
    return pids


def link_installed(name: str, version: str, image: Path) -> bool:
    """Hard-link distribution `name` at `version` (any local build: +cpu) and the distributions it needs, with their
    bytecode, from this test environment into the virtual environment `image`: what `pip install` of the wheel on disk
    did in 19-28 s (unpacking, then compiling ~15,000 files), in about a second. The links stay root's, as a chown would
    change this environment's files (the same inodes), and nothing writes through them: an install replaces files and
    Python writes bytecode by renaming a new file; the directories made here are the bed user's, as pip's were.
    False, with nothing written, where this environment holds another version, Python or file system."""
    import importlib.metadata as metadata
    import importlib.util

    from packaging.requirements import Requirement

    site = image / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    if not site.is_dir():
        return False  # another Python than the image's

    def key(dist: metadata.Distribution) -> str:
        return dist.metadata["Name"].lower().replace("_", "-")

    seen = {key(dist) for dist in metadata.distributions(path=[str(site)])}  # the image's own (pip, setuptools) stay
    try:
        if metadata.version(name).split("+")[0] != version:
            return False
        dists, wanted = [], [name]
        while wanted:
            dist = metadata.distribution(wanted.pop())
            if key(dist) in seen:
                continue
            seen.add(key(dist))
            dists.append(dist)
            needs = (Requirement(text) for text in dist.requires or [])
            wanted += [r.name for r in needs if r.marker is None or r.marker.evaluate({"extra": ""})]
    except metadata.PackageNotFoundError:
        return False
    if any(not dist.files for dist in dists):
        return False  # a distribution without its RECORD: what it holds is unknown
    files = []  # (the environment's site-packages, a path in it)
    for dist in dists:
        root = Path(dist.locate_file(""))
        for file in dist.files:
            if file.parts[0] == "..":  # scripts in bin/: their first line names this environment's python
                continue
            files.append((root, Path(file)))
            if file.suffix == ".py":
                files.append((root, Path(importlib.util.cache_from_source(str(file)))))
    if any(os.stat(root).st_dev != os.stat(site).st_dev for root in {root for root, _ in files}):
        return False  # hard links need one file system
    user = pwd.getpwnam(USER)
    for root, file in files:
        if not (root / file).is_file() or (site / file).exists():
            continue  # bytecode never written here, or linked already
        for new in [p for p in (site / file).parents if not p.exists()][::-1]:
            new.mkdir()
            os.chown(new, user.pw_uid, user.pw_gid)
        os.link(root / file, site / file)
    for dist in dists:  # their commands (torchrun), as pip writes them for the image's python
        for entry in dist.entry_points.select(group="console_scripts"):
            module, _, attr = entry.value.partition(":")
            script = image / "bin" / entry.name
            script.write_text(f"#!{image}/bin/python\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                              f"sys.exit({attr}())\n")  # fmt: skip
            script.chmod(0o755)
            os.chown(script, user.pw_uid, user.pw_gid)
    return True


def main() -> int:
    """`make sky-bed`: the same bed for a person: up, the commands to try, down when Enter is pressed (or on Ctrl-C)."""
    import tempfile

    why = installed_or_why()
    if why:
        print(f"sky-bed: {why}", file=sys.stderr)
        return 2
    exit_on_signals()
    root = Path(tempfile.mkdtemp(prefix=Path(BED_HOMES).name + "-", dir=Path(BED_HOMES).parent))
    atexit.register(shutil.rmtree, root, True)  # also when stopped while it comes up or waits (after the bed's exit)
    print(f"[bed] bringing up 2 Slurm nodes, a login node and SkyPilot's API server under {root} ...", flush=True)
    with SkyBed(root, managed=True, visible=None) as bed:
        image = bed.orch_image()
        repo = Path(__file__).resolve().parent.parent
        path = os.path.normpath(Path(sys.executable).parent)
        env = f"HOME={bed.client} SKYPILOT_USER_ID={bed.user_hash} PATH={path}:$PATH"
        print(f"""
[bed] up. In another shell, from {repo}:
  export {env}; unset SKYPILOT_DISABLE_LOCAL_API_SERVER
  sky check slurm
  python3 scripts/on-slurm.py recipes/phi3_dpo_fsdp.yaml > /tmp/phi3_slurm.yaml
  sky launch /tmp/phi3_slurm.yaml --infra slurm/{bed.name} --gpus none --num-nodes 2 -c phi3 -y \\
      --env ORCH_DEVICE=cpu --env ORCH_SMOKE=on --env ORCH_VENV={image}
  sky queue phi3; sky logs phi3 1 --no-follow; sky down phi3 -y
and orch, through the same API server:
  orch run phi3_dpo_fsdp --infra slurm/{bed.name} --nodes 2 --gpus none --smoke --cluster o1 -y --detach \
      --env ORCH_VENV={image} max_steps=40
  orch status; orch logs RUN --follow; orch cancel RUN; orch run --resume RUN -y; orch down RUN
(a SkyPilot cluster holds its Slurm nodes until `sky down`: the bed has two)
""", flush=True)  # fmt: skip
        if bed.managed:
            print(f"""[bed] SkyPilot's jobs controller runs inside its API server (consolidation mode): a managed job,
  orch run phi3_dpo_fsdp --infra slurm/{bed.name} --nodes 2 --gpus none --smoke --managed -y --detach \
      --env ORCH_VENV={image} max_steps=200
  sky jobs queue; sky jobs logs 1 --no-follow
""", flush=True)  # fmt: skip
        try:
            input("[bed] press Enter to take it down\n")
        except (EOFError, KeyboardInterrupt):
            pass
        print("[bed] taking it down ...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    print(f"[bed] down: no process, namespace, user or file of the bed is left ({root} removed)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
