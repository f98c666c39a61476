"""The nodes' setup: one lock (uv.lock) installed by uv, the model and data prefetched."""

import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
import tomllib
import yaml
from conftest import ROOT, orch
from hub_standin import Hub, save_kernel

from orchestrator.core import accelerate_schema, overrides, trl_schema
from orchestrator.core import attention as attention_names
from orchestrator.core.errors import OrchError
from orchestrator.core.timeline import setup_times_file
from orchestrator.launch import storage
from orchestrator.node.exec import setup_times
from orchestrator.train import attention_kernel

pytestmark = pytest.mark.cli

LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
LOCKED = {p["name"]: p["version"] for p in LOCK["package"] if "version" in p}
TASKS = sorted((ROOT / "recipes").glob("*.yaml"))
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


# ---------------------------------------------------------------- one lock, the same versions everywhere


def test_lock_holds_the_versions_the_launch_sides_snapshots_came_from():
    for package, version in {**trl_schema.versions(), **accelerate_schema.schema()["versions"]}.items():
        assert LOCKED[package] == version, (package, LOCKED.get(package), version)


def test_lock_is_current_with_pyproject():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "lock", "--check", "--offline"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, "uv.lock does not match pyproject.toml: run `make lock`\n" + result.stderr[-1500:]


def test_this_machines_torch_is_the_locked_one():
    """make install puts the CPU build of the lock's torch here (uv cannot see that wheel)."""
    assert f"torch=={LOCKED['torch']}" in (ROOT / "Makefile").read_text()
    import torch

    assert torch.__version__.split("+")[0] == LOCKED["torch"]


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_recipe_setup_installs_from_the_lock(path):
    """Every recipe's setup runs the lock's installer with extras that exist; its run uses that environment."""
    task = yaml.safe_load(path.read_text())
    match = re.search(r"^bash scripts/node-setup\.sh ([a-z,]+)\b", task["setup"], re.M)
    assert match, f"{path.stem}: setup does not run scripts/node-setup.sh"
    extras = match.group(1).split(",")
    assert "train" in extras and set(extras) <= EXTRAS
    if task["envs"].get("TRL_TRAINER") == "grpo" and "use_vllm" in (ROOT / task["envs"]["TRL_CONFIG"]).read_text():
        assert "vllm" in extras, f"{path.stem} generates with vLLM"
    trl = yaml.safe_load((ROOT / task["envs"]["TRL_CONFIG"]).read_text())
    attention, _ = attention_names.requested(overrides.effective(trl, overrides.loads(task["envs"]["TRL_OVERRIDES"])))
    if attention_names.may_need_hub(attention):  # transformers loads it with the kernels package (trl[kernels])
        assert "gpu" in extras, f"{path.stem}'s attention {attention} is a Kernels Hub kernel: its setup needs gpu"
    assert "pip install" not in task["setup"]
    assert 'export PATH="${ORCH_VENV:-${ORCH_HOME:-$HOME/.orch}/venv}/bin:$PATH"' in task["run"]
    assert "orch node" in task["run"]


# ---------------------------------------------------------------- the setup script, for real, offline


@pytest.fixture
def hub(tmp_path):
    """A model and a dataset saved to disk, served over HTTP by a stand-in for the Hub (huggingface_hub's real
    client, no network); one repo gated."""
    from orchestrator.core import smoke

    artifacts = smoke.plan("microsoft/Phi-3-mini-4k-instruct", "dpo")
    smoke.ensure(artifacts)
    root = tmp_path / "hub"
    shutil.copytree(artifacts.dir / "model", root / "models" / "org" / "tiny-phi3")
    shutil.copytree(artifacts.dir / "model", root / "models" / "org" / "gated-phi3")
    shutil.copytree(artifacts.dir / "data", root / "datasets" / "org" / "prefs")
    with Hub(root, gated={"org/gated-phi3"}) as server:
        yield server


def hub_recipe(project: Path, model: str) -> dict[str, str]:
    """The recipe's envs as a node gets them, pointing at the stand-in Hub's repos."""
    trl = yaml.safe_load((project / "recipes" / "trl" / "phi3_dpo.yaml").read_text())
    trl.update(model_name_or_path=model, dataset_name="org/prefs")
    (project / "recipes" / "trl" / "hub.yaml").write_text(yaml.safe_dump(trl))
    envs = yaml.safe_load((project / "recipes" / "phi3_dpo_fsdp.yaml").read_text())["envs"]
    return {**{k: str(v) for k, v in envs.items()}, "TRL_CONFIG": "recipes/trl/hub.yaml"}


@pytest.mark.e2e
def test_setup_installs_the_lock_into_an_image_with_torch_prefetches_and_skips_on_reuse(tmp_path, hub):
    # An environment with torch already in it, as on a GPU image. Wheels come from uv's cache (filled by
    # `make install`) or the package registry; the model and data from the stand-in Hub.
    venv = tmp_path / "image-env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "-q", f"torch=={LOCKED['torch']}"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    project = tmp_path / "repo"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".venv", ".git", "outputs", "sky_jobs", "__pycache__"))
    env = {
        **os.environ,
        **hub_recipe(project, "org/tiny-phi3"),
        "ORCH_VENV": str(venv),
        "ORCH_HOME": str(tmp_path / "orch-home"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": hub.endpoint,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # the head node of a 2-node cluster, as SkyPilot's setup sees it; its rehearsal runs in the new environment
        "SKYPILOT_SETUP_NODE_RANK": "0",
        "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2\n",
        "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "2",
        "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": "c1", "cloud": "Slurm", "region": "bed", "zone": None}),
        "ORCH_REHEARSAL": "on",
        "ORCH_CACHE_DIR": str(tmp_path / "orch-cache"),
        "ORCH_TRACK": "tiny_phi3",  # --track: the nodes also get the `track` extra (Trackio)
        "ORCH_PREFETCH_PROGRESS_S": "1",  # a progress line every second while the download is held (default 30)
        # the download is held for as long as the rehearsal runs (13 s once under a loaded suite): longer than the
        # Hub client's 10 s read timeout
        "HF_HUB_DOWNLOAD_TIMEOUT": "300",
    }
    # The download runs while the head node rehearses: the stand-in Hub holds every file download until the
    # rehearsal's line is out, so the setup only ends if the two ran at once.
    hub.hold.clear()
    errors = tmp_path / "setup.err"
    with open(errors, "w") as err:
        setup = subprocess.Popen(["bash", "scripts/node-setup.sh", "train"], cwd=project, env=env,
                                 stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        lines = []
        for line in setup.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("[orch] rehearsed "):
                break
        in_flight = hub.downloading.is_set()
        hub.hold.set()
        rest, _ = setup.communicate(timeout=900)
    out = "".join(lines) + rest
    assert setup.returncode == 0, out[-3000:] + errors.read_text()[-3000:]
    assert in_flight, "the rehearsal ended before any download had started"
    # whole progress lines in the log the rehearsal shares, not redrawn bars glued to its lines
    assert re.search(r"^\[orch\] prefetch: [\d.]+ GB downloaded so far \(\d+ s\)$", out, re.M), out[-3000:]
    assert "\r" not in out + errors.read_text()
    assert f"torch {LOCKED['torch']} is there: kept" in out
    assert re.search(r"installing uv\.lock's orch\[train,track\] \(\d+ packages\)", out)
    assert "[orch] prefetch: model org/tiny-phi3:" in out and "[orch] prefetch: dataset org/prefs:" in out
    assert re.search(r"^\[orch\] rehearsed 2 role\(s\) of 4 rank\(s\) with transformers ", out, re.M), out[-3000:]
    # the environment holds the lock's versions, and orch from this checkout
    freeze = subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "pip", "freeze", "--python", str(venv / "bin/python")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    installed = dict(line.split("==", 1) for line in freeze.splitlines() if "==" in line)
    for package in ("trl", "transformers", "accelerate", "deepspeed", "datasets", "huggingface-hub", "tokenizers",
                    "trackio"):  # fmt: skip
        assert installed[package] == LOCKED[package], package
    assert installed["torch"].split("+")[0] == LOCKED["torch"]
    # the training processes read the prefetched cache: with the Hub switched off, the model and data load
    load = (
        "from transformers import AutoModelForCausalLM; from datasets import load_dataset;"
        "AutoModelForCausalLM.from_pretrained('org/tiny-phi3'); print(len(load_dataset('org/prefs')['train']))"
    )
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    loaded = subprocess.run([str(venv / "bin/python"), "-c", load], env=offline, capture_output=True, text=True)
    assert loaded.returncode == 0 and loaded.stdout.strip().endswith("128"), loaded.stderr[-2000:]
    # read back as the head node's `orch node` reads it in the run (SkyPilot's run names the node SKYPILOT_NODE_RANK)
    run_env = {k: v for k, v in env.items() if not k.startswith("SKYPILOT_SETUP_")} | {"SKYPILOT_NODE_RANK": "0"}
    times = {k.removeprefix("setup_"): v for k, v in setup_times(run_env).items()}
    assert times["started"] <= times["installed"] <= times["rehearsed"] <= times["prefetched"] <= times["done"]
    assert [p.name for p in (tmp_path / "orch-home").glob("*.times")] == [Path(setup_times_file(env, "")).name]
    # a reused cluster: the second setup installs nothing
    again = subprocess.run(
        ["bash", "scripts/node-setup.sh", "train"], cwd=project, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "orch[train,track] (installed by an earlier setup): nothing to install" in again.stdout
    assert "installing" not in again.stdout
    assert re.search(r"^\[orch\] rehearsed 2 role\(s\) .*\(cached\)$", again.stdout, re.M)

    def leftover() -> str:  # this environment's rehearsal or download, still running
        found = subprocess.run(["pgrep", "-af", f"{venv}/bin/(orch node|python -m orchestrator)"], capture_output=True,
                               text=True).stdout  # fmt: skip
        return found.strip()

    # A rehearsal that fails stops the download in flight: the setup ends with the rehearsal's line, nothing left.
    bad = yaml.safe_load((project / "recipes" / "trl" / "hub.yaml").read_text())
    bad["model_init_kwargs"] = {"bogus_kw": 1}  # the trainer's model build raises: a rehearsal's finding
    (project / "recipes" / "trl" / "bad.yaml").write_text(yaml.safe_dump(bad))
    hub.hold.clear()
    hub.downloading.clear()
    fresh = {**env, "TRL_CONFIG": "recipes/trl/bad.yaml", "HF_HOME": str(tmp_path / "hf-empty")}
    failed = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=project, env=fresh, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    held = not hub.hold.is_set()
    hub.hold.set()
    assert failed.returncode == 2, failed.stdout[-2000:] + failed.stderr[-2000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("orch: error:")]
    assert len(errors) == 1 and errors[0] == failed.stderr.strip().splitlines()[-1], failed.stderr[-2000:]  # once, last
    assert errors[0].startswith("orch: error: rehearsal: the head (node 0) would fail on its GPUs")
    assert "bogus_kw" in errors[0]
    assert held and hub.downloading.is_set() and "[orch] prefetch: model" not in failed.stdout  # stopped mid-download
    assert not leftover()
    # A download that fails (a gated model, no token) ends the setup with its line last, the rehearsal stopped if it
    # was still running.
    gated = {**env, **hub_recipe(project, "org/gated-phi3"), "HF_HOME": str(tmp_path / "hf-gated")}
    gated.pop("HF_TOKEN", None)
    refused = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=project, env=gated, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("orch: error:")]
    assert len(errors) == 1 and errors[0] == refused.stderr.strip().splitlines()[-1], refused.stderr[-2000:]
    assert errors[0].startswith("orch: error: model org/gated-phi3 is gated on the Hugging Face Hub"), errors[0]
    assert not leftover()
    # The environment's orch is a copy: it starts with the checkout that installed it gone (the first cluster of a
    # shared environment was taken down), and a setup from another checkout installs nothing.
    moved = project.rename(tmp_path / "next-cluster")
    hub_recipe(moved, "org/tiny-phi3")  # the gated case above rewrote hub.yaml

    def starts() -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin/orch"), "--version"], cwd="/", capture_output=True, text=True)

    def setup_from(checkout: Path) -> str:
        done = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    assert starts().returncode == 0, starts().stderr
    out = setup_from(moved)
    assert "installing" not in out and "orch's own command" not in out, out
    # One installed editable by an earlier setup (before this one made copies), its checkout gone: replaced by a copy.
    old = tmp_path / "old-checkout"
    shutil.copytree(moved, old)
    uv = str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin/python"), "--no-deps", "-e", str(old)],
                   check=True, capture_output=True)  # fmt: skip
    shutil.rmtree(old)
    assert starts().returncode != 0
    out = setup_from(moved)
    assert f"orch's own command from this checkout ({moved}): the one installed before is gone" in out, out
    assert "installing" not in out
    assert starts().returncode == 0, starts().stderr


def clean_env() -> dict[str, str]:
    """This process's environment without orch's and SkyPilot's variables: a node's before its task sets any."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "SKYPILOT_"))}


def slurm_account(tmp_path: Path, cluster: str = "c1", image_python: Path | None = None) -> dict[str, str]:
    """A node's environment as SkyPilot's Slurm provisioner gives it: $HOME is <account home>/.sky_clusters/<cluster>
    (getent, on PATH first, names the account's home); python3 is the image's."""
    account = tmp_path / "account"
    home = account / ".sky_clusters" / cluster
    home.mkdir(parents=True, exist_ok=True)
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    (tools / "getent").write_text(f'#!/bin/sh\necho "u:x:0:0::{account}/:/bin/bash"\n')
    (tools / "getent").chmod(0o755)
    if image_python:
        (tools / "python3").unlink(missing_ok=True)
        (tools / "python3").symlink_to(image_python)
    env = clean_env()
    return env | {"HOME": str(home), "PATH": f"{tools}{os.pathsep}{env['PATH']}"}


def venv_of(env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "scripts/node-setup.sh", "--print-venv", "train"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout.strip()


def test_on_a_slurm_home_the_environment_is_the_accounts_one_per_lock_and_image_python(tmp_path):
    # SkyPilot gives each Slurm cluster its own $HOME: a per-cluster ~/.orch/venv installed uv.lock again at every
    # new cluster (torch too, where the image has none). The default is one environment per lock and image python on
    # the account's home, which every cluster of that lock finds installed.
    with_torch = Path(sys.executable)  # holds the locked torch (test_this_machines_torch_is_the_locked_one)
    one = slurm_account(tmp_path, "c1", with_torch)
    venv = venv_of(one)
    assert re.fullmatch(rf"{tmp_path}/account/\.cache/orch/venvs/[0-9a-f]{{16}}-[0-9a-f]{{8}}", venv), venv
    assert venv_of(slurm_account(tmp_path, "c2", with_torch)) == venv  # another cluster of the account: the same
    bare = venv_of(slurm_account(tmp_path, "c3", Path("/usr/bin/python3")))  # an image python without torch
    assert bare != venv and bare.startswith(f"{tmp_path}/account/.cache/orch/venvs/")
    # anywhere else, a set ORCH_VENV, or a cluster whose ~/.orch/venv is an environment of its own: as before
    elsewhere = {**one, "HOME": str(tmp_path / "vm")}
    assert venv_of(elsewhere) == f"{tmp_path}/vm/.orch/venv"
    assert venv_of({**one, "ORCH_VENV": "/opt/env"}) == "/opt/env"
    assert venv_of({**one, "ORCH_HOME": "/scratch/orch"}) == "/scratch/orch/venv"  # where the `run:` looks
    (Path(one["HOME"]) / ".orch" / "venv" / "bin").mkdir(parents=True)
    assert venv_of(one) == f"{one['HOME']}/.orch/venv"


def test_the_run_puts_first_on_path_the_environment_the_setup_installed(tmp_path):
    # The setup installs where ORCH_VENV, else ORCH_HOME, else ~/.orch says; every recipe's `run:` must look in the
    # same place (it read ~/.orch/venv whatever ORCH_HOME said). On a Slurm home the setup links ~/.orch/venv (below).
    exports = {
        next(line.strip() for line in yaml.safe_load(path.read_text())["run"].splitlines() if "export PATH=" in line)
        for path in TASKS
    }
    base = clean_env() | {"HOME": str(tmp_path)}
    for export in exports:
        for extra in ({}, {"ORCH_HOME": f"{tmp_path}/orch-home"}, {"ORCH_VENV": f"{tmp_path}/env"},
                      {"ORCH_HOME": f"{tmp_path}/orch-home", "ORCH_VENV": f"{tmp_path}/env"}):  # fmt: skip
            env = base | extra
            first = subprocess.run(["bash", "-c", export + '\nprintf %s "${PATH%%:*}"'], env=env, capture_output=True,
                                   text=True, check=True).stdout  # fmt: skip
            assert first == venv_of(env) + "/bin", (export, extra)


def test_a_new_cluster_links_the_accounts_installed_environment_and_installs_nothing(tmp_path):
    # An environment of this lock made by an earlier cluster of the account (its stamp, a python that runs orch):
    # a new cluster's setup installs nothing and links ~/.orch/venv, which its `run:` puts on PATH, to it.
    one = slurm_account(tmp_path, "c1", Path(sys.executable))
    venv = Path(venv_of(one))
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "orch"):
        (venv / "bin" / name).write_text(f'#!/bin/sh\nexec {Path(sys.executable).parent / name} "$@"\n')
        (venv / "bin" / name).chmod(0o755)
    key = venv.name.split("-")[0]
    (venv / f".orch-setup-{key}-train").touch()
    node = {"SKYPILOT_SETUP_NODE_RANK": "1", "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2",
            "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "0", "ORCH_DEVICE": "cpu", "ORCH_SKIP_PREFETCH": "1"}  # fmt: skip
    for cluster in ("c1", "c2"):
        env = slurm_account(tmp_path, cluster) | node
        tools, rest = env["PATH"].split(os.pathsep, 1)
        env["PATH"] = os.pathsep.join([tools, str(Path(sys.executable).parent), rest])  # uv, after the image's python3
        done = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{venv} already holds uv.lock's orch[train] (installed by an earlier setup): nothing to install" in (
            done.stdout
        )
        assert "installing" not in done.stdout and "orch's own command" not in done.stdout, done.stdout
        link = Path(env["HOME"]) / ".orch" / "venv"
        assert link.is_symlink() and os.readlink(link) == str(venv)
    assert sorted(p.name for p in venv.parent.iterdir()) == [venv.name, f"{venv.name}.lock"]  # nothing made beside it

    # The account's environments of other locks: removed only when finished by a setup (its stamp), named as a setup
    # names them, linked from no cluster, unused for 7 days and not locked by a setup installing into it.
    def made(name: str, days: float, stamp: bool = True) -> Path:
        env_dir = venv.parent / name
        (env_dir / "bin").mkdir(parents=True)
        if stamp:
            (env_dir / f".orch-setup-{name[:16]}-train").touch()
            (env_dir / ".orch-used").touch()
        for path in [env_dir, *env_dir.iterdir()]:
            os.utime(path, (time.time() - days * 86400,) * 2)
        return env_dir

    stale = made("a" * 16 + "-" + "1" * 8, 8)
    recent = made("b" * 16 + "-" + "2" * 8, 1)
    unfinished = made("c" * 16 + "-" + "3" * 8, 30, stamp=False)
    other_name = made("not-a-setups-name", 30)
    linked = made("d" * 16 + "-" + "4" * 8, 30)
    stopped = Path(slurm_account(tmp_path, "c3")["HOME"]) / ".orch"  # a stopped cluster's home keeps its link
    stopped.mkdir()
    (stopped / "venv").symlink_to(linked)
    busy = made("e" * 16 + "-" + "5" * 8, 30)
    with open(f"{busy}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a setup installing into it
        done = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not stale.exists() and not list(venv.parent.glob("*.removing-*"))
    assert all(d.exists() for d in (recent, unfinished, other_name, linked, busy, venv))
    removed = [line for line in done.stdout.splitlines() if "removed" in line]
    assert removed == [f"[orch] setup: removed {stale}: an environment of another lock that no cluster links to, "
                       "unused for 7 days"], done.stdout  # fmt: skip
    assert (venv / ".orch-used").stat().st_mtime > time.time() - 60  # this setup used its own


def test_orch_node_runs_the_workdirs_orch_not_the_one_its_environment_was_installed_from(tmp_path):
    # An environment shared by clusters was installed (editable) from another cluster's workdir: `orch node` started
    # in this task's workdir runs this workdir's orch, and so do the processes it starts (`python -m` from there).
    checkout = tmp_path / "workdir"
    shutil.copytree(ROOT / "orchestrator", checkout / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
    with open(checkout / "orchestrator" / "commands" / "node.py", "a") as f:
        f.write("\nimport sys as _sys\nprint('this workdir:', __file__, _sys.path[0], flush=True)\n")
    orch_command = Path(sys.executable).parent / "orch"  # installed from ROOT
    env = {k: v for k, v in os.environ.items() if k != "ORCH_NODE_WORKDIR"}
    here = subprocess.run([str(orch_command), "node", "--help"], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert here.returncode == 0, here.stderr
    assert here.stdout.startswith(f"this workdir: {checkout}/orchestrator/commands/node.py {checkout}\n"), here.stdout
    # started anywhere else (no orch checkout there), or in the checkout it was installed from: its own
    for cwd in (tmp_path, ROOT):
        other = subprocess.run([str(orch_command), "node", "--help"], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert other.returncode == 0 and other.stdout.startswith("usage: orch node"), other.stdout + other.stderr
    # a directory removed under it: its own
    gone = subprocess.run(["bash", "-c", f"mkdir gone && cd gone && rmdir ../gone && {orch_command} node --help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert gone.returncode == 0 and gone.stdout.startswith("usage: orch node"), gone.stdout + gone.stderr
    # a Python that never puts the directory first (PYTHONSAFEPATH) starts again once, then runs what it has
    safe = subprocess.run([str(orch_command), "node", "--help"], cwd=checkout, env={**env, "PYTHONSAFEPATH": "1"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert safe.returncode == 0 and safe.stdout.startswith("usage: orch node"), safe.stdout + safe.stderr


@pytest.mark.e2e
def test_prefetch_names_the_fix_for_a_gated_model(tmp_path, hub, project):
    env = {**os.environ, **hub_recipe(project, "org/gated-phi3"), "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": hub.endpoint}  # fmt: skip
    env.pop("HF_TOKEN", None)
    run = [sys.executable, "-m", "orchestrator.train.prefetch"]
    refused = subprocess.run(run, cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    errors = [x for x in refused.stderr.splitlines() if x.startswith("orch: error:")]
    line = refused.stderr.strip().splitlines()[-1]  # the run ends with one error line (progress output may precede)
    assert errors == [line] and line.startswith("orch: error: model org/gated-phi3 is gated on the Hugging Face Hub")
    assert "give HF_TOKEN as a secret (`--secret HF_TOKEN` to orch run or sky launch)" in line
    allowed = subprocess.run(run, cwd=project, env={**env, "HF_TOKEN": hub.token}, capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "[orch] prefetch: model org/gated-phi3:" in allowed.stdout
    missing = subprocess.run(run, cwd=project, env={**env, **hub_recipe(project, "org/nope")}, capture_output=True,
                             text=True)  # fmt: skip
    assert missing.returncode == 2 and "model org/nope does not exist on the Hugging Face Hub" in missing.stderr


@pytest.mark.e2e  # ~15 s: 3 timed-out tries and their pauses, twice
def test_prefetch_tries_a_stalled_download_again_then_refuses_in_one_line(tmp_path, hub, project):
    # huggingface_hub does not retry a file's GET: a Hub that stalls past HF_HUB_DOWNLOAD_TIMEOUT ended the node's
    # setup with httpx's traceback (seen in the suite). Now each repo gets ATTEMPTS tries, then one line naming the fix.
    env = {**os.environ, **hub_recipe(project, "org/tiny-phi3"), "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": hub.endpoint, "HF_HUB_DOWNLOAD_TIMEOUT": "1"}  # fmt: skip
    run = [sys.executable, "-m", "orchestrator.train.prefetch"]
    hub.hold.clear()  # every file download stalls
    try:
        stalled = subprocess.run(run, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    finally:
        hub.hold.set()
    assert stalled.returncode == 2 and "Traceback" not in stalled.stderr, stalled.stderr[-3000:]
    line = stalled.stderr.strip().splitlines()[-1]
    assert [x for x in stalled.stderr.splitlines() if x.startswith("orch: error:")] == [line], stalled.stderr
    assert re.fullmatch(rf"orch: error: (model org/tiny-phi3|dataset org/prefs) could not be downloaded from "
                        rf"{re.escape(hub.endpoint)}: no answer within 1 s \(\w+\), 3 tries; check the node's network "
                        r"\(or HF_ENDPOINT\), or raise HF_HUB_DOWNLOAD_TIMEOUT for a slow link; nodes with no route "
                        r"to the Hub: fill HF_HOME's cache where there is one and set HF_HUB_OFFLINE=1", line), line
    assert "trying again (2/3)" in stalled.stdout and "trying again (3/3)" in stalled.stdout, stalled.stdout
    # a stall that ends while tries are left: the download goes on from there
    hub.hold.clear()
    with subprocess.Popen(run, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as recovering:  # fmt: skip
        seen = []
        for out_line in recovering.stdout:  # type: ignore[union-attr]
            seen.append(out_line)
            if "trying again (2/3)" in out_line:
                hub.hold.set()
        rest = recovering.stderr.read()  # type: ignore[union-attr]
    hub.hold.set()
    assert recovering.returncode == 0, "".join(seen)[-2000:] + rest[-2000:]
    assert any("[orch] prefetch: model org/tiny-phi3:" in x for x in seen), seen


@pytest.mark.e2e
def test_prefetch_on_a_node_with_no_route_to_the_hub_reads_the_cache_hf_hub_offline_names(tmp_path, hub, project):
    """Nodes with no route to the Hub (many Slurm clusters) set HF_HUB_OFFLINE=1 over a cache filled beforehand. The
    setup tried the Hub 3 times anyway and refused ('could not be downloaded ... offline mode is enabled'); now it
    reads each repo from the cache as the training will, asking nothing (the endpoint is a closed port), and a repo the
    cache lacks is one line saying how to fill it, at once."""
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    online.update(hub_recipe(project, "org/tiny-phi3"), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.endpoint)
    run = [sys.executable, "-m", "orchestrator.train.prefetch"]
    filled = subprocess.run(run, cwd=project, env=online, capture_output=True, text=True, timeout=120)
    assert filled.returncode == 0, filled.stderr[-2000:]
    offline = {**online, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    requests = len(hub.requests)
    cached = subprocess.run(run, cwd=project, env=offline, capture_output=True, text=True, timeout=120)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert "[orch] prefetch: model org/tiny-phi3: " in cached.stdout and "[orch] prefetch: dataset org/prefs: " in (
        cached.stdout) and "trying again" not in cached.stdout + cached.stderr  # fmt: skip
    assert len(hub.requests) == requests
    # a streamed dataset is read from the Hub as the ranks train: not downloaded, and refused where HF_HUB_OFFLINE
    # keeps the nodes off the Hub (the ranks' first batch would fail, after the model loaded)
    streams = {**offline, "TRL_OVERRIDES": "dataset_streaming=true"}
    refused = subprocess.run(run, cwd=project, env=streams, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "orch: error: dataset org/prefs is streamed (dataset_streaming) from the Hub as the ranks train, and "
        "HF_HUB_OFFLINE=1 keeps the nodes off the Hub: set dataset_streaming=false (the setup then reads it from the "
        "cache) or unset HF_HUB_OFFLINE"
    ), refused.stderr[-2000:]
    streams = {**online, "TRL_OVERRIDES": "dataset_streaming=true", "HF_HOME": str(tmp_path / "streams")}
    streamed = subprocess.run(run, cwd=project, env=streams, capture_output=True, text=True, timeout=120)
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    said = "[orch] prefetch: dataset org/prefs is streamed by the ranks as they train: not downloaded"
    assert said in streamed.stdout, streamed.stdout
    assert not (tmp_path / "streams" / "hub" / "datasets--org--prefs").exists()  # only the model came down
    assert (tmp_path / "streams" / "hub" / "models--org--tiny-phi3").is_dir(), streamed.stdout
    for model, missing in (("org/tiny-phi3", "model org/tiny-phi3"), (str(tmp_path), "dataset org/prefs")):
        trl = {**yaml.safe_load((project / "recipes" / "trl" / "hub.yaml").read_text()), "model_name_or_path": model}
        (project / "recipes" / "trl" / "hub.yaml").write_text(yaml.safe_dump(trl))
        empty = subprocess.run(run, cwd=project, env={**offline, "HF_HOME": str(tmp_path / "empty")},
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr[-3000:]
        assert empty.stderr.strip().splitlines()[-1] == (
            f"orch: error: {missing} is not in this node's Hugging Face cache ({tmp_path / 'empty' / 'hub'}), and "
            "HF_HUB_OFFLINE=1 keeps the node off the Hub: fill that cache where the Hub can be reached (this setup "
            "there, with the same HF_HOME), or unset HF_HUB_OFFLINE"
        )


@pytest.mark.unit
def test_prefetch_leaves_a_streamed_dataset_to_the_ranks_and_a_mixture_replaces_dataset_name():
    from orchestrator.train import prefetch

    def names(**settings) -> list[str]:
        return [r.repo_id for r in prefetch.repos({"model_name_or_path": "org/m", **settings})]

    assert names(dataset_name="org/d") == ["org/m", "org/d"]
    assert names(dataset_name="org/d", dataset_streaming="true") == ["org/m"]
    assert prefetch.streamed({"dataset_name": "org/d", "dataset_streaming": "1"}) == ["org/d"]
    mixture = [{"path": "org/a"}, {"path": "org/b", "name": "en"}]
    assert names(dataset_name="org/d", datasets=mixture) == ["org/m", "org/a", "org/b"]  # TRL ignores dataset_name
    assert names(datasets=mixture, streaming=True) == ["org/m"]
    assert names(datasets=mixture, dataset_streaming=True) == ["org/m", "org/a", "org/b"]  # a mixture's own key


@pytest.fixture
def kernel_hub(tmp_path):
    """Kernels Hub repos served by the stand-in: CPU-runnable attention kernels from kernels-community (flash-attn2,
    the recipes' and transformers' fallback for flash_attention_2) and from a publisher the Hub does not trust, and one
    with only a CUDA build."""
    root = tmp_path / "hub"
    for repo in ("kernels-community/flash-attn2", "kernels-community/tiny-flash", "someone/tiny-flash"):
        save_kernel(root, repo)
    save_kernel(root, "kernels-community/cuda-flash", "torch213-cxx11-cu130-x86_64-linux")
    (root / "models").mkdir()
    with Hub(root) as server:
        yield server


def kernel_recipe(project: Path, attention: str, **extra: str) -> dict[str, str]:
    """The envs of a recipe whose model and data are local and whose attention is `attention`."""
    trl = {"model_name_or_path": str(project), "dataset_name": str(project), "attn_implementation": attention}
    (project / "recipes" / "trl" / "kernel.yaml").write_text(yaml.safe_dump(trl))
    return {"TRL_CONFIG": "recipes/trl/kernel.yaml", **extra}


@pytest.mark.e2e  # 4 processes that import transformers
def test_prefetch_fetches_and_loads_the_attention_kernel_the_ranks_load_so_an_offline_rank_finds_it(
    tmp_path, kernel_hub, project
):
    """transformers loads a Hub-named attn_implementation (and flash_attention_2 without the flash-attn package) from
    the Kernels Hub in every rank's from_pretrained, after the launch. The setup's prefetch now runs that loader once
    per node: the kernel lands in the cache the ranks read, and a rank with HF_HUB_OFFLINE=1 loads it without the Hub
    (the kernels package alone would not find the version it downloaded: attention_kernel._keep_version)."""
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    online.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=kernel_hub.endpoint)
    run = [sys.executable, "-m", "orchestrator.train.prefetch"]
    # flash_attention_2: no flash-attn package here, so the recipes' kernel, at the version transformers asks (3)
    fetched = subprocess.run(run, cwd=project, env={**online, **kernel_recipe(project, "flash_attention_2")},
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    assert "[orch] prefetch: attention kernel kernels-community/flash-attn2: 0.00 GB in the cache, loaded (torch-cpu " \
        "build)" in fetched.stdout, fetched.stdout
    assert "GET /api/kernels/kernels-community/flash-attn2/refs" in kernel_hub.requests
    offline = {**online, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    requests = len(kernel_hub.requests)
    rank = ("from transformers.modeling_flash_attention_utils import lazy_import_flash_attention as load; "
            "print(load('kernels-community/flash-attn2')[0][1].__name__)")  # what from_pretrained calls  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", rank], env=offline, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "flash_attn_varlen_func", loaded.stderr[-3000:]
    recipe = kernel_recipe(project, "kernels-community/flash-attn2")  # as the recipes name it
    cached = subprocess.run(run, cwd=project, env={**offline, **recipe}, capture_output=True, text=True, timeout=300)
    assert cached.returncode == 0 and "loaded (torch-cpu build)" in cached.stdout, cached.stderr[-3000:]
    assert len(kernel_hub.requests) == requests
    empty = subprocess.run(run, cwd=project, env={**offline, "HF_HOME": str(tmp_path / "empty"), **recipe},
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr[-3000:]
    assert empty.stderr.strip().splitlines()[-1] == (
        f"orch: error: attention kernel kernels-community/flash-attn2 is not in this node's Hugging Face cache "
        f"({tmp_path / 'empty' / 'hub'}), and HF_HUB_OFFLINE=1 keeps the node off the Hub: fill that cache where the "
        "Hub can be reached (this setup there, with the same HF_HOME), or unset HF_HUB_OFFLINE"
    )


@pytest.mark.e2e  # ~4 processes that import transformers
@pytest.mark.parametrize(
    ("attention", "refusal"),
    [
        ("someone/tiny-flash", r"attention kernel someone/tiny-flash cannot be loaded on this node, as every rank "
         r"would load it: ValueError: Kernel repository 'someone/tiny-flash' is not from a trusted publisher; set "
         r'model_init_kwargs=\{"allow_all_kernels": true\} if you trust its code, or another attn_implementation'),
        ("kernels-community/cuda-flash", r"attention kernel kernels-community/cuda-flash cannot be loaded on this "
         r"node, as every rank would load it: FileNotFoundError: Cannot find a build variant for this system in "
         r"kernels-community/cuda-flash \(revision: 0{40}\); it has no build for this node's torch, accelerator and "
         r"platform: choose another attn_implementation"),
        ("kernels-community/nope", r"attention kernel kernels-community/nope does not exist on the Hugging Face Hub "
         r"\(or this node may not read it: give HF_TOKEN\); check attn_implementation in the TRL config"),
    ],
    ids=["untrusted publisher", "no build for this node", "no such kernel"],
)
def test_prefetch_refuses_an_attention_kernel_no_rank_could_load_in_one_line(
    tmp_path, kernel_hub, project, attention, refusal
):
    env = {**os.environ, **kernel_recipe(project, attention), "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": kernel_hub.endpoint}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    refused = subprocess.run([sys.executable, "-m", "orchestrator.train.prefetch"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert [x for x in refused.stderr.splitlines() if x.startswith("orch: error:")] == [line]
    assert re.fullmatch(f"orch: error: {refusal}", line), line


def refused_at_port_9(label: str) -> str:
    """The prefetch's last line for a repo whose Hub (HF_ENDPOINT=http://127.0.0.1:9, where nothing listens) refused
    every try."""
    return (f"orch: error: {label} could not be downloaded from http://127.0.0.1:9: ConnectError: [Errno 111] "
            "Connection refused, 3 tries; check the node's network (or HF_ENDPOINT), or raise HF_HUB_DOWNLOAD_TIMEOUT "
            "for a slow link; nodes with no route to the Hub: fill HF_HOME's cache where there is one and set "
            "HF_HUB_OFFLINE=1")  # fmt: skip


@pytest.mark.e2e  # 2 processes that import transformers, ~3 s of pauses between tries
def test_a_kernel_download_the_link_fails_is_tried_again_and_named_as_the_network(tmp_path, kernel_hub, project):
    """The kernel's download had no second try, and a Hub the node could not reach at all was worded as the kernels
    package's publisher check words it ('could not verify publisher trust status'), with the advice to trust every
    publisher. Now a dropped link is tried again, as for the model and the data (transformers remembers a name it
    failed to load: attention_kernel.fetch forgets it, or the second try loads nothing), and a Hub that cannot be
    reached is the network's line."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(kernel_recipe(project, "flash_attention_2"), HF_HOME=str(tmp_path / "hf"))
    run = [sys.executable, "-m", "orchestrator.train.prefetch"]
    kernel_hub.drop = 1  # the first request: the publisher check, which the kernels package wraps
    again = subprocess.run(run, cwd=project, env={**env, "HF_ENDPOINT": kernel_hub.endpoint}, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert kernel_hub.requests[0].startswith("dropped GET /api/organizations/kernels-community"), kernel_hub.requests
    assert re.search(r"^\[orch\] prefetch: attention kernel kernels-community/flash-attn2: RemoteProtocolError: .*; "
                     r"trying again \(2/3\)$", again.stdout, re.M), again.stdout  # fmt: skip
    assert "kernels-community/flash-attn2: 0.00 GB in the cache, loaded (torch-cpu build)" in again.stdout
    kernel_hub.unavailable = 1  # the Hub's own failure to answer the publisher check: not a verdict on the publisher
    failed = subprocess.run(run, cwd=project, env={**env, "HF_ENDPOINT": kernel_hub.endpoint, "HF_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert re.fullmatch(r"orch: error: attention kernel kernels-community/flash-attn2 \(attn_implementation "
                        r"flash_attention_2\) cannot be loaded on this node: the Hub failed to say whether its "
                        r"publisher is trusted \(HTTP 503: Server error '503 Service Unavailable' for url "
                        r"'\S+/api/organizations/kernels-community/overview'\); run the setup again later, or check "
                        r"HF_ENDPOINT",
                        failed.stderr.strip().splitlines()[-1]), failed.stderr[-2000:]  # fmt: skip
    unreachable = subprocess.run(run, cwd=project, env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"},
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr, unreachable.stderr[-3000:]
    last = unreachable.stderr.strip().splitlines()[-1]
    assert last == refused_at_port_9("attention kernel kernels-community/flash-attn2"), last


@pytest.mark.e2e  # imports transformers
def test_a_hub_attention_kernel_without_the_kernels_package_is_one_line_naming_the_gpu_extra(monkeypatch):
    """A copied recipe whose setup installs `train` alone, given a Hub attention kernel: every rank's from_pretrained
    raised transformers' ImportError after the launch; the setup now says which extra to install."""
    from transformers.integrations import hub_kernels

    assert attention_kernel.repo("kernels-community/flash-attn2") == "kernels-community/flash-attn2"
    assert attention_kernel.repo("flash_attention_2") == "kernels-community/flash-attn2"  # no flash-attn package here
    assert attention_kernel.repo("sdpa") is None and not attention_names.may_need_hub("sdpa")
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda *a, **k: False)  # what transformers decides by
    with pytest.raises(OrchError, match=r"^attn_implementation flash_attention_2 loads the Kernels Hub kernel "
                       r"kernels-community/flash-attn2, but this node has no kernels package in the version "
                       r"transformers accepts: install orch's gpu extra \(the recipe's setup: bash scripts/node-setup"
                       r"\.sh train,gpu\), or set attn_implementation=sdpa$"):  # fmt: skip
        attention_kernel.repo("flash_attention_2")


def test_the_attention_kernel_the_ranks_load_is_the_one_model_init_kwargs_names():
    """train/entry.build lets model_init_kwargs (a mapping, or TRL's JSON text from a key=value) win over
    attn_implementation; allow_all_kernels is read there too; paged| names (inference) load the same kernel."""
    assert attention_names.requested({"attn_implementation": "org/a"}) == ("org/a", False)
    assert attention_names.requested({"attn_implementation": "sdpa", "model_init_kwargs": {
        "attn_implementation": "org/b", "allow_all_kernels": True}}) == ("org/b", True)  # fmt: skip
    text = '{"attn_implementation": "paged|org/c@v2:fn", "allow_all_kernels": "false"}'
    assert attention_names.requested({"model_init_kwargs": text}) == ("org/c@v2:fn", False)
    assert attention_names.requested({}) == (None, False)
    assert [attention_names.may_need_hub(a) for a in ("eager", "flex_attention", "flash_attention_3", "a/b")] == [
        False, False, True, True]  # fmt: skip


@pytest.mark.e2e
def test_the_kernels_package_still_leaves_a_version_it_downloaded_unreadable_offline(tmp_path, kernel_hub):
    """attention_kernel._keep_version exists because the kernels package downloads version N as a commit and then,
    offline, looks for the version's ref, which it never wrote. When this fails, it writes it: drop _keep_version."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=kernel_hub.endpoint)
    get = "from kernels import get_kernel; get_kernel('kernels-community/tiny-flash', version=2)"
    done = subprocess.run([sys.executable, "-c", get], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    offline = subprocess.run([sys.executable, "-c", get], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert offline.returncode == 1 and "Version 2 of 'kernels-community/tiny-flash' is not available in the local " \
        "cache" in offline.stderr, "the kernels package now loads offline what it downloaded: drop _keep_version"


@pytest.mark.e2e  # ~7 s of tries and their pauses
def test_prefetch_quotes_a_refused_connection_not_the_hub_clients_closed_error(tmp_path, project):
    """huggingface_hub 1.16 retries a refused connection with the HTTP client it has just closed
    (prefetch.CLOSED_CLIENT, fixed upstream where SkyPilot's click pin keeps the lock from going): a dataset's download
    ended in that RuntimeError's traceback, with no try again and no word of the network. Now: its tries, then one
    line quoting the connection's own error."""
    trl = {"model_name_or_path": str(tmp_path), "dataset_name": "org/prefs"}
    (project / "trl.yaml").write_text(yaml.safe_dump(trl))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(TRL_CONFIG="trl.yaml", HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens
    refused = subprocess.run([sys.executable, "-m", "orchestrator.train.prefetch"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == refused_at_port_9("dataset org/prefs")
    assert "org/prefs: ConnectError: [Errno 111] Connection refused; trying again (3/3)" in refused.stdout


RANK_LOAD = """
import sys
from orchestrator.train import hub_link
print("mended", hub_link.mend_retries() if sys.argv[1] == "mend" else False, flush=True)
from huggingface_hub import hf_hub_download
try:
    print("got", open(hf_hub_download("org/m", "config.json")).read(), flush=True)
except Exception as exc:
    print("failed", repr(hub_link.link_error(exc) or exc), flush=True)
"""


@pytest.mark.e2e  # ~5 s: the Hub comes up 2.5 s after the first try, which huggingface_hub's retry waits out
@pytest.mark.parametrize("mend", ["mend", "as installed"])
def test_a_rank_loads_from_a_hub_that_refused_its_first_connection(tmp_path, mend):
    """A training rank loads its model's and dataset's files through huggingface_hub's retry, which 1.16 ends at
    once on its closed client after a refused connection (a DNS or network blip ended the run; the rank quoted the
    RuntimeError). train/entry mends it (hub_link.mend_retries): the retry reaches the Hub once it answers. The library
    as installed is the control: it fails, while the bug is in it."""
    import socket
    import threading

    from huggingface_hub import __version__ as hub_version

    from orchestrator.train import hub_link

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = tmp_path / "hub"
    (root / "models" / "org" / "m").mkdir(parents=True)
    (root / "models" / "org" / "m" / "config.json").write_text('{"model_type": "qwen2"}')
    servers: list = []

    def later():
        time.sleep(2.5)  # after the first try (its process starts, imports, asks): refused
        servers.append(Hub(root, port=port).__enter__())

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HUB_DISABLE_XET="1")
    starter = threading.Thread(target=later)
    starter.start()
    try:
        done = subprocess.run([sys.executable, "-c", RANK_LOAD, mend], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    finally:
        starter.join()
        for server in servers:
            server.__exit__(None, None, None)
    assert "'[Errno 111] Connection refused' thrown while requesting HEAD" in done.stderr, done.stderr[-2000:]
    fixed = tuple(int(p) for p in hub_version.split(".")[:2]) >= hub_link.FIXED_IN
    if mend == "mend" or fixed:
        assert done.stdout.splitlines()[-1] == 'got {"model_type": "qwen2"}', done.stdout + done.stderr[-2000:]
    else:
        assert done.stdout.splitlines()[-1] == f"failed RuntimeError('{hub_link.CLOSED_CLIENT}.')", done.stdout


def test_orch_pull_from_an_unreachable_hub_names_the_network_not_a_token(tmp_path):
    probe = ("from pathlib import Path; from orchestrator.launch import model_out; "
             f"model_out.download('org/model', Path({str(tmp_path / 'out')!r}))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    done = subprocess.run([sys.executable, "-c", probe], env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("orchestrator.core.errors.OrchError: could not download org/model from the Hub ("), last
    assert "ConnectError: [Errno 111] Connection refused" in last and "HF_TOKEN" not in last, last
    assert last.endswith("); this machine could not reach the Hub: check its network (or HF_ENDPOINT) and run "
                         "`orch pull` again"), last  # fmt: skip


def test_the_hub_clients_closed_retry_is_still_in_the_installed_huggingface_hub():
    """The workaround above stays only while the bug does: a huggingface_hub that takes its client on each try (1.27+)
    fails this, so that prefetch.CLOSED_CLIENT and its handling go, and hub_link.mend_retries with them."""
    import inspect

    from huggingface_hub.utils import _http

    source = inspect.getsource(_http._http_backoff_base)
    assert source.index("client = get_session()") < source.index("while True"), (
        "huggingface_hub now opens its client on each try: drop prefetch.CLOSED_CLIENT and its handling, and "
        "hub_link.mend_retries"
    )


# ---------------------------------------------------------------- a bucket of one's own


def test_shipped_bucket_names_become_the_users_own():
    assert storage.shipped_bucket("orch-phi3-dpo-checkpoints") and not storage.shipped_bucket("my-team-ckpts")
    name = storage.personal_bucket("phi3_dpo_fsdp", "1a2b3c4d")
    assert name == "orch-phi3-dpo-fsdp-1a2b3c4d"
    assert len(storage.personal_bucket("x" * 300, "1a2b3c4d")) <= 63
    assert re.fullmatch(r"[0-9a-f]{8}", storage.user_id())


def test_cloud_launch_says_which_bucket_it_uses():
    derived = orch("run", "phi3_dpo_fsdp", "--nodes", "2", "--dry-run", "--skip-optimizer")
    assert derived.returncode == 0, derived.stderr
    name = re.search(r"^\[orch\] checkpoints: bucket (orch-phi3-dpo-fsdp-[0-9a-f]{8}) ", derived.stdout, re.M).group(1)
    assert f"CHECKPOINT_BUCKET: {name}" in derived.stdout
    assert f"checkpoints and final model: bucket {name} mounted at /checkpoints" in derived.stdout
    chosen = orch("run", "phi3_dpo_fsdp", "--env", "CHECKPOINT_BUCKET=team-ckpt", "--dry-run", "--skip-optimizer")
    assert "[orch] checkpoints: bucket" not in chosen.stdout and "CHECKPOINT_BUCKET: team-ckpt" in chosen.stdout


def test_on_slurm_drops_the_bucket_and_roots_checkpoints_on_the_shared_home(tmp_path):
    """scripts/on-slurm.py: the recipe as a Slurm task (no object store to mount there), the rest untouched; SkyPilot's
    own parser takes it."""
    import sky

    done = subprocess.run([sys.executable, "scripts/on-slurm.py", "recipes/phi3_dpo_fsdp.yaml"], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    task = yaml.safe_load(done.stdout)
    recipe = yaml.safe_load((ROOT / "recipes" / "phi3_dpo_fsdp.yaml").read_text())
    assert "file_mounts" not in task and "CHECKPOINT_BUCKET" not in task["envs"]
    assert task["envs"]["CHECKPOINT_ROOT"] == "~/orch-checkpoints"
    assert {k: v for k, v in task.items() if k != "envs"} == {k: v for k, v in recipe.items()
                                                             if k not in ("envs", "file_mounts")}  # fmt: skip
    assert done.stdout.startswith("# recipes/phi3_dpo_fsdp.yaml for a Slurm cluster")
    assert sky.Task.from_yaml_config(task).num_nodes == 1
    bad = subprocess.run([sys.executable, "scripts/on-slurm.py", "nowhere.yaml"], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("on-slurm: error: nowhere.yaml:")


@pytest.mark.root
@pytest.mark.unit
def test_each_node_of_each_cluster_has_its_own_setup_timings_file():
    """On Slurm every node of every cluster of the account shares the home: one setup.times was truncated and appended
    by all of them at once. The setup (SKYPILOT_SETUP_NODE_RANK) and the run (SKYPILOT_NODE_RANK) name the same file."""
    one = {"SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": "a", "cloud": "Slurm", "region": "r", "zone": None})}
    other = {"SKYPILOT_CLUSTER_INFO": one["SKYPILOT_CLUSTER_INFO"].replace('"a"', '"b"')}
    names = {setup_times_file({**info, var: rank}, "/h") for info in (one, other) for rank in ("0", "1")
             for var in ("SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_NODE_RANK")}  # fmt: skip
    assert len(names) == 4 and all(n.startswith("/h/setup-") and n.endswith(".times") for n in names), names
    assert setup_times_file({}, "/h") == setup_times_file({"SKYPILOT_NODE_RANK": "0"}, "/h")  # no SkyPilot: node 0
    assert setup_times_file({"SKYPILOT_NODE_RANK": "../1"}, "/h") is None


@pytest.mark.cli
@pytest.mark.parametrize("var", ["SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_NODE_RANK"])  # the setup stage's, else run's
def test_setup_refuses_a_node_rank_that_is_not_a_number_naming_where_it_came_from(tmp_path, var):
    env = {k: v for k, v in os.environ.items() if not k.endswith("NODE_RANK")}
    env.update({"ORCH_HOME": str(tmp_path / "home"), var: "../../etc/x"})
    done = subprocess.run(["bash", "scripts/node-setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == f"orch: error: node rank '../../etc/x' is not a number ({var})\n"
    assert not (tmp_path / "home").exists()  # nothing written


@pytest.mark.root  # it runs the setup as the user nobody
def test_setup_stops_with_one_line_when_it_cannot_take_the_install_lock():
    # Nodes that share ORCH_VENV (a Slurm home) install one at a time under ORCH_VENV.lock. A user who cannot write
    # that lock is told so before anything is installed, instead of two nodes racing into one environment.
    base = Path(tempfile.mkdtemp(prefix="orch-lock-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home"
        home.mkdir(mode=0o777)
        home.chmod(0o777)
        (base / "image").mkdir()  # root's: nobody cannot write image.lock beside it
        project = base / "repo"
        project.mkdir()
        for name in ("uv.lock", "pyproject.toml"):
            shutil.copy(ROOT / name, project)
        shutil.copytree(ROOT / "scripts", project / "scripts")
        tools = base / "bin"  # uv where `nobody` can run it (a checkout under a 0700 directory is out of its reach)
        tools.mkdir()
        shutil.copy(Path(sys.executable).parent / "uv", tools / "uv")
        env = {"PATH": f"{tools}:/usr/bin:/bin", "HOME": str(home),
               "ORCH_HOME": str(home / ".orch"), "ORCH_VENV": str(base / "image" / "venv")}  # fmt: skip
        done = subprocess.run(["runuser", "-u", "nobody", "--", "env", *[f"{k}={v}" for k, v in env.items()], "bash",
                               "scripts/node-setup.sh", "train"], cwd=project, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [
            f"orch: error: node 0 setup: cannot write {base}/image/venv.lock (the lock that lets one node install at a "
            f"time): make {base}/image writable by nobody, or set ORCH_VENV to a directory under a writable parent"
        ]
        assert not (base / "image" / "venv").exists()
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize(
    "fails, error",
    [
        ("pip install", "error: Failed to fetch: `https://pypi.org/simple/accelerate/`"),
        ("pip install", "error: Failed to download `deepspeed==0.18.2`"),  # uv's `× Failed to download ...`
        ("export", ""),  # a tool that said no `error:` of its own: the step and its exit code still
    ],
)
def test_a_failed_install_ends_the_setup_with_one_line_naming_the_step_and_uvs_error(tmp_path, fails, error):
    """The setup's last line, which `orch run` and `orch logs` quote for a failed job (launch/job_end.py), names the
    step that failed and quotes uv's own first error line; before, uv's lines were the setup's last and no node line
    said what failed."""
    real = shutil.which("uv", path=str(Path(sys.executable).parent))
    said = {"error: Failed to download `deepspeed==0.18.2`": "  × Failed to download `deepspeed==0.18.2`\n"
            "  ├─▶ Failed to fetch: `https://files.pythonhosted.org/...`\n  ╰─▶ Request failed after 3 retries\n"}
    message = said.get(error, f"{error}\n  Caused by: Request failed after 3 retries\n" if error else "warning: none\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    fail = f"  printf '%s' {shlex.quote(message)} >&2; exit 2"
    (tools / "uv").write_text(f'#!/bin/bash\nif [ "$1 $2" = "{fails}" ] || [ "$1" = "{fails}" ]; then\n'
                              f'{fail}\nfi\nexec {real} "$@"\n')  # fmt: skip
    (tools / "uv").chmod(0o755)
    # an environment of its own that sees the test environment's packages (a .pth): it holds the locked torch, which
    # the setup keeps. A bare symlink to this interpreter was the base Python's outside its venv: where that Python
    # lacked torch, the setup downloaded torch's CUDA build (5 GB) into it. uv offline: nothing is ever downloaded.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    found = sysconfig.get_path("purelib", vars={"base": str(env)})  # the new venv's site-packages, same Python
    Path(found, "test-env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    node = clean_env() | {"HOME": str(tmp_path), "ORCH_VENV": str(env), "UV_OFFLINE": "1"}
    node["PATH"] = f"{tools}{os.pathsep}{node['PATH']}"
    done = subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=node)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.rstrip().splitlines()[-1]
    step = f"installing uv.lock's orch[train] into {env}" if fails == "pip install" else (
        "exporting uv.lock's orch[train]")  # fmt: skip
    assert last == f"orch: error: node 0 setup failed while {step} (exit 2)" + (f": {error}" if error else ""), last
    assert message.splitlines()[0] in done.stderr  # uv's own lines stay, above it
    assert done.stderr.count("orch: error:") == 1
    assert f"torch {LOCKED['torch']} is there: kept" in done.stdout + done.stderr


def nvidia_smi(tools: Path, cuda: str = "13.0") -> None:
    """An `nvidia-smi` whose `-L` lists one GPU, as on a node with NVIDIA GPUs, and whose `-q` says the newest CUDA
    its driver runs."""
    (tools / "nvidia-smi").write_text(
        '#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'
        f'[ "$1" = -q ] && printf "\\nDriver Version                            : 580.65.06\\n'
        f'CUDA Version                              : {cuda}\\n"\nexit 0\n')  # fmt: skip
    (tools / "nvidia-smi").chmod(0o755)


def gpu_node(tmp_path: Path, cuda: str = "13.0") -> tuple[dict[str, str], Path, Path]:
    """A node with NVIDIA GPUs (nvidia_smi: its driver runs CUDA up to `cuda`) whose ORCH_VENV sees this environment's
    packages, torch 2.13.0+cpu among them, and whose uv logs its arguments to the returned file and refuses any
    `pip install` as offline: (the node's environment, its ORCH_VENV, uv's log)."""
    calls, tools = tmp_path / "uv-calls", tmp_path / "tools"
    tools.mkdir()
    real = shutil.which("uv", path=str(Path(sys.executable).parent))
    (tools / "uv").write_text(f'#!/bin/bash\necho "$*" >> {calls}\nif [ "$1 $2" = "pip install" ]; then\n'
                              f'  echo "error: offline" >&2; exit 2\nfi\nexec {real} "$@"\n')  # fmt: skip
    (tools / "uv").chmod(0o755)
    nvidia_smi(tools, cuda)
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    Path(sysconfig.get_path("purelib", vars={"base": str(env)}), "test-env.pth").write_text(
        sysconfig.get_path("purelib") + "\n")
    node = clean_env() | {"HOME": str(tmp_path), "ORCH_VENV": str(env), "UV_OFFLINE": "1"}
    node["PATH"] = f"{tools}{os.pathsep}{node['PATH']}"
    return node, env, calls


def setup(node: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/node-setup.sh", "train"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=node)  # fmt: skip


def test_a_node_with_nvidia_gpus_does_not_keep_a_cpu_build_of_torch(tmp_path):
    """The locked torch kept from an environment, any build: on a node with NVIDIA GPUs not a CPU one (+cpu), whose
    ranks would each train alone on the CPU (orch node refuses it: tests/test_torch_build.py). The setup installs the
    lock's torch over it, a reinstall (uv takes 2.13.0+cpu for ==2.13.0); here uv stops there, offline. An image
    python with a CPU build is not made the environment's base (the account's environment key says so)."""
    node, env, calls = gpu_node(tmp_path)
    done = setup(node)
    assert done.returncode == 2, done.stdout + done.stderr
    torch = LOCKED["torch"]
    assert (f"[orch] setup: torch {torch} in {env} is a CPU build, and this node has NVIDIA GPUs: installing the "
            "lock's (CUDA)") in done.stdout, done.stdout
    assert done.stderr.rstrip().splitlines()[-1] == (f"orch: error: node 0 setup failed while installing torch {torch} "
                                                     "(exit 2): error: offline")  # fmt: skip
    assert f"pip install -q --python {env}/bin/python --reinstall-package torch torch=={torch}" in calls.read_text()
    # the account's environment on a Slurm home: made from the image python where its torch is kept, here not. The
    # image python runs the environment above (a wrapper: a venv's python symlinked elsewhere is the base Python's)
    base = tmp_path / "slurm"
    slurm_account(base, "c1")
    (base / "tools" / "python3").write_text(f'#!/bin/sh\nexec {env}/bin/python "$@"\n')
    (base / "tools" / "python3").chmod(0o755)
    kept = venv_of(slurm_account(base, "c1"))
    nvidia_smi(base / "tools")
    assert venv_of(slurm_account(base, "c2")) != kept  # the same image python, the same lock


def test_a_node_whose_driver_cannot_run_the_locked_torch_build_stops_before_installing_it(tmp_path):
    """uv.lock's torch is a CUDA 13.0 build (its cuda-toolkit); a driver that runs CUDA up to 12.2 (skypilot#9406:
    SkyPilot's AWS image, driver 535) cannot run it: torch would see no GPU. The setup says so before downloading
    several GB of it, and ORCH_CUDA_ARCH_CHECK=off goes on (here into uv, stopped offline)."""
    node, _, calls = gpu_node(tmp_path, cuda="12.2")
    tools = tmp_path / "tools"
    done = setup(node)
    assert done.returncode == 2, done.stdout + done.stderr
    torch = LOCKED["torch"]
    assert done.stderr.splitlines()[-1] == (
        f"orch: error: node 0 setup: this node's NVIDIA driver runs CUDA up to 12.2 (nvidia-smi -q), and uv.lock's "
        f"torch {torch} is a CUDA 13.0 build, which needs a driver for CUDA 13: torch would see no GPU; use an image "
        f"with a newer driver, or one holding torch {torch}'s CUDA 12.9 build (12.6 for a V100), which the setup keeps "
        f"(pip install torch=={torch} --index-url https://download.pytorch.org/whl/cu129); ORCH_CUDA_ARCH_CHECK=off "
        "installs it anyway"), done.stderr
    assert done.stderr.count("orch: error:") == 1 and not calls.exists()  # uv not asked for anything: no download
    anyway = setup(node | {"ORCH_CUDA_ARCH_CHECK": "off"})
    assert anyway.stderr.splitlines()[-1] == f"orch: error: node 0 setup failed while installing torch {torch} " \
        "(exit 2): error: offline", anyway.stderr  # fmt: skip
    nvidia_smi(tools, cuda="13.0")  # driver 580: the lock's torch is installed (uv is asked for it)
    newer = setup(node)
    assert "installing torch" in newer.stderr.splitlines()[-1], newer.stderr
