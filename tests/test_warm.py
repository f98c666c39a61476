"""A node's setup compiles what its ranks import (node/warm.py, train/warm.py): uv installs without bytecode, so on a
new cloud node the ranks compiled TRL, transformers, peft, datasets and DeepSpeed after the launch. Each test gives
Python a PYTHONPYCACHEPREFIX holding only torch's bytecode (as an image's pip-installed torch has it): this environment
then looks, to every process, as a new node's uv install leaves it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from conftest import ROOT
from new_node import new_node_prefix, worker_env

from orchestrator.node import warm

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
# The packages a uv install leaves without bytecode and the warm-up is for (torch comes with the image)
WARMED = ("trl", "transformers", "accelerate", "peft", "datasets", "deepspeed")


def compiled(prefix: Path) -> set[Path]:
    """The site-packages sources that have bytecode under the prefix."""
    root = prefix / SITE.relative_to("/")
    return {p.relative_to(root) for p in root.rglob("*.pyc")} if root.exists() else set()


def rehearse(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """`orch node --rehearse --warm` as node-setup.sh runs it after installing the environment."""
    return subprocess.run([sys.executable, "-m", "orchestrator", "node", "--rehearse", *(flags or ("--warm",))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.e2e
def test_a_worker_node_compiles_what_its_ranks_import_once_and_they_compile_nothing_more(tmp_path, project):
    prefix = new_node_prefix(tmp_path / "pycache")
    env = worker_env(prefix)
    missing, _ = warm.cold("dpo")
    assert not missing, "this environment should be warm (make install compiles it)"
    times = tmp_path / "setup.times"
    first = rehearse(env, "--warm", "--times", str(times))
    assert first.returncode == 0, first.stderr[-3000:]
    # a worker's timings do not say it: rank 0's line reads the head's alone
    assert [line.split("=")[0] for line in times.read_text().splitlines()] == ["rehearsed"]
    lines = first.stdout.splitlines()
    assert lines[0] == "[orch] rehearsal: node 1 leaves it to the head node"
    assert lines[1].startswith("[orch] warmed the dpo training stack's bytecode (") and lines[1].endswith(
        " s): this node's ranks start without compiling it"), first.stdout  # fmt: skip
    warmed = compiled(prefix)
    for package in WARMED:
        assert any(p.parts[0] == package for p in warmed), package
    # A reused node pays nothing: the sentinels' bytecode is there (and its setup installs nothing, so it does not ask).
    again = rehearse(env)
    assert again.returncode == 0 and again.stdout == "[orch] rehearsal: node 1 leaves it to the head node\n", again
    # The ranks of a real 2-node run on that environment (the launcher, FSDP2, DPO with its reference model, the
    # checkpoint) compile nothing of the warmed packages but the model's own modules, which may still be downloading
    # during the setup.
    keeps = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as on a node: bytecode is kept
    run = subprocess.run([sys.executable, "-m", "orchestrator", "run", "phi3_dpo_fsdp", "--local", "--nodes", "2",
                          "--smoke", "--fresh", "-y", "max_steps=1"], cwd=project, capture_output=True, text=True,
                         env={**keeps, "PYTHONPYCACHEPREFIX": str(prefix)}, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    new = sorted(p for p in compiled(prefix) - warmed if p.parts[0] in WARMED)
    assert all(p.parts[:3] == ("transformers", "models", "phi3") for p in new), [str(p) for p in new]
    assert any(p.parts[:3] == ("transformers", "models", "phi3") for p in new), "the run compiled nothing?"


@pytest.mark.e2e
def test_a_head_node_without_a_rehearsal_warms_after_it_and_its_setup_times_say_so(tmp_path):
    """ORCH_REHEARSAL=off (or a cached rehearsal) imports nothing on the head: it warms too, after, and rank 0's
    time-to-first-step line shows the warm-up apart from the rehearsal (core/timeline.py)."""
    env = {**worker_env(new_node_prefix(tmp_path / "pycache")), "SKYPILOT_SETUP_NODE_RANK": "0",
           "ORCH_REHEARSAL": "off", "ORCH_MEMORY_CHECK": "off", "ORCH_DISK_CHECK": "off"}  # fmt: skip
    times = tmp_path / "setup.times"
    done = rehearse(env, "--warm", "--times", str(times))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()  # after the memory and disk lines
    assert lines[2:4] == ["[orch] rehearsal: skipped (ORCH_REHEARSAL=off)", lines[3]], done.stdout
    assert lines[3].startswith("[orch] warmed the dpo training stack's bytecode ("), done.stdout
    recorded = dict(line.split("=") for line in times.read_text().splitlines())
    assert list(recorded) == ["rehearsed", "warmed"] and float(recorded["warmed"]) > float(recorded["rehearsed"])


@pytest.mark.cli
def test_nothing_to_warm_says_nothing_and_bytecode_nobody_keeps_is_named(tmp_path):
    # a setup that installed nothing (a reused node, or one whose shared environment another node installed, which
    # the head's rehearsal compiles) does not ask for it
    unasked = rehearse(worker_env(tmp_path / "empty"), "--times", str(tmp_path / "setup.times"))
    assert unasked.returncode == 0 and unasked.stdout == "[orch] rehearsal: node 1 leaves it to the head node\n"
    alone = subprocess.run([sys.executable, "-m", "orchestrator", "node", "--warm"], cwd=ROOT, env=worker_env(tmp_path),
                           capture_output=True, text=True)  # fmt: skip
    assert alone.returncode == 2 and alone.stderr == ("orch: error: --warm goes with --rehearse (scripts/node-setup.sh "
                                                      "passes both after an install)\n")  # fmt: skip
    warm_env = worker_env(tmp_path / "unused")
    warm_env.pop("PYTHONPYCACHEPREFIX")  # this environment, compiled by make install
    quiet = rehearse(warm_env)
    assert quiet.returncode == 0 and quiet.stdout == "[orch] rehearsal: node 1 leaves it to the head node\n"
    # PYTHONDONTWRITEBYTECODE: no process keeps what it compiles, so warming would cost the setup and save nothing
    kept_by_none = rehearse({**worker_env(tmp_path / "empty"), "PYTHONDONTWRITEBYTECODE": "1"})
    assert kept_by_none.returncode == 0
    assert kept_by_none.stdout.splitlines()[1] == ("[orch] bytecode not warmed: PYTHONDONTWRITEBYTECODE is set, so "
                                                   "every process on this node compiles it")  # fmt: skip
    # a trainer TRL_TRAINER does not name: the head's rehearsal refuses it, the worker does not guess
    unknown = rehearse({**worker_env(tmp_path / "empty"), "TRL_TRAINER": "nope"})
    assert unknown.returncode == 0 and unknown.stdout == "[orch] rehearsal: node 1 leaves it to the head node\n"


@pytest.mark.cli
@pytest.mark.root
def test_a_read_only_bytecode_directory_is_named_not_warmed(tmp_path):
    """An image's site-packages the node's user cannot write (here a read-only bind mount, which binds root too):
    every process compiles it again, so warming would cost each setup and save nothing."""
    prefix = tmp_path / "pycache"
    prefix.mkdir()
    script = (f"mount --bind {prefix} {prefix} && mount -o remount,ro,bind {prefix} && "
              f"exec {sys.executable} -m orchestrator node --rehearse --warm")  # fmt: skip
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                          env=worker_env(prefix), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[1] == ("[orch] bytecode not warmed: torch/__init__.py's directory is read-only, so "
                                           "every process compiles it"), done.stdout  # fmt: skip


@pytest.mark.e2e
def test_a_stopped_setup_stops_the_warm_up_and_leaves_nothing(tmp_path):
    """node-setup.sh stops `orch node --rehearse` (SIGTERM) when the download fails first: the importing process goes
    with it."""
    env = worker_env(new_node_prefix(tmp_path / "pycache"))
    node = subprocess.Popen([sys.executable, "-m", "orchestrator", "node", "--rehearse", "--warm"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def warming() -> list[int]:  # this test's importing process (its prefix in its environment)
        found = subprocess.run(["pgrep", "-f", "--", "-m orchestrator.train.warm dpo"], capture_output=True, text=True)
        pids = []
        for pid in found.stdout.split():
            try:
                if env["PYTHONPYCACHEPREFIX"].encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    pids.append(int(pid))
            except OSError:  # gone meanwhile
                pass
        return pids

    deadline = time.monotonic() + 60
    while not warming() and time.monotonic() < deadline and node.poll() is None:
        time.sleep(0.1)
    started = warming()
    assert started, "the warm-up never started"
    node.send_signal(signal.SIGTERM)
    _, err = node.communicate(timeout=30)
    assert node.returncode != 0 and "orch: interrupted (SIGTERM)" in err, err[-2000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in started)


@pytest.mark.e2e
def test_every_trainer_has_a_warm_up_that_imports(capsys):
    """What the warm-up imports for each trainer orch runs exists (TRL's script module and trainer class), in this
    process: after the first, each costs little."""
    from orchestrator.core import trainers
    from orchestrator.train import warm as train_warm

    for name in trainers.TRAINERS:
        assert train_warm.main([name]) == 0, name
        out = capsys.readouterr().out  # DeepSpeed prints its accelerator notice on stdout too
        assert [line for line in out.splitlines() if line.startswith("ORCH_WARM ")], (name, out)
    assert train_warm.main(["nope"]) == 2 and "usage: python -m orchestrator.train.warm" in capsys.readouterr().err
