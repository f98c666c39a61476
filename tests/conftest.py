import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).parent / "snapshots"

os.environ["SKYPILOT_DISABLE_LOCAL_API_SERVER"] = "1"
# Launches are rehearsed against the training stack (seconds each): tests/test_rehearsal.py turns it on where it is
# the subject; elsewhere it would only repeat that work.
os.environ.setdefault("ORCH_REHEARSAL", "off")
os.environ.setdefault("ORCH_DATA_CHECK", "off")  # the one-row dataset check: on in test_recipes.py only
os.environ.setdefault("ORCH_KERNEL_CHECK", "off")  # the attention kernel asked of the Hub: on in test_kernel_check.py


def _scratch(prefix: str) -> str:
    """A directory of this test process's own in the temporary directory, removed when the process exits (not when a
    child forked from it does)."""
    path, owner = tempfile.mkdtemp(prefix=prefix), os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    return path


# A cache of tiny smoke models and rehearsals private to this test session (CI builds them from scratch): made by the
# first pytest process, whose pytest-xdist workers inherit it with its environment: a model one worker built, the other
# finds (builds and cache writes are atomic).
if "ORCH_CACHE_DIR" not in os.environ:
    os.environ["ORCH_CACHE_DIR"] = _scratch("orch-test-cache-")
# Nor the developer's Hugging Face cache: datasets caches every smoke dataset it loads under HF_HOME (a new one each
# session, whose smoke data is new); tests about HF_HOME set their own.
if "ORCH_TEST_HF_HOME" not in os.environ:
    os.environ["HF_HOME"] = os.environ["ORCH_TEST_HF_HOME"] = _scratch("orch-test-hf-")
# The processes the tests start (orch, accelerate's launchers, uv's builds, SkyPilot's) keep their temporary files in
# one directory of this session's, removed at its end: torch's elastic agent, uv's editable builds and SkyPilot's
# killed workers otherwise leave torchelastic_*, uv-setuptools-*.lock and sky-tmp* behind in the machine's /tmp (dozens
# a suite run). Made by the first pytest process, like the cache above, and sticky and world-writable like /tmp (the
# Slurm and SkyPilot tests run processes as other users); that process keeps its own temporary directory for its own
# files (pytest's basetemp: its last three runs stay for a look).
if "ORCH_TEST_TMPDIR" not in os.environ:
    tempfile.gettempdir()  # this process's, chosen before TMPDIR moves for its children
    os.environ["TMPDIR"] = os.environ["ORCH_TEST_TMPDIR"] = _scratch("orch-test-tmp-")
    os.chmod(os.environ["TMPDIR"], 0o1777)
    # torch's JIT-built C++ ops too (~/.cache/torch_extensions otherwise): none is built on CPU today (DeepSpeed's
    # shared-memory op is skipped, orchestrator/train/cpu_deepspeed.py), and one that is goes with the session
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(os.environ["TMPDIR"], "torch_extensions")
# Never the developer's own SkyPilot state (state.db, catalogs): SKY_RUNTIME_DIR, one per process, since the state is
# one SQLite file (a worker inherits the first process's and makes its own). Tests that need a catalog set their own;
# the SkyPilot bed's client keeps its state in its own home.
if os.environ.get("SKY_RUNTIME_DIR", "") in ("", os.environ.get("ORCH_TEST_SKY_RUNTIME_DIR")):
    os.environ["SKY_RUNTIME_DIR"] = os.environ["ORCH_TEST_SKY_RUNTIME_DIR"] = _scratch("orch-test-sky-")


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous (taken by the OS, then released): orch's own picker."""
    from orchestrator.launch.backends.local_nodes import free_ports

    return free_ports(1)[0]


def orch(*args: str, env: dict | None = None, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (exit codes, stdout/stderr, no shared state)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def plan(capsys, monkeypatch, tmp_path):
    """`orch plan ...` in this process (the CLI's own main: exit code, stdout, stderr): a subprocess paid Python's and
    SkyPilot's imports again for every plan (~2.5 s each here)."""
    from orchestrator import cli

    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> subprocess.CompletedProcess:
        code = cli.main(["plan", *argv])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)

    return run


def supervised(rank: str, home: Path, env: dict | None = None, settings: dict | None = None, node_rank: int = 0,
               tmpdir: str | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:  # fmt: skip
    """node/supervise.supervise() over a stand-in rank (`python -c RANK ARGS`), in a process of its own (it makes its
    process a child subreaper); the watchdog off, ORCH_HOME at `home`; `tmpdir`: that process's TMPDIR."""
    runner = (
        "import json, sys; from orchestrator.node.supervise import supervise; "
        "env = {'PATH': '/usr/bin:/bin', 'ORCH_WATCHDOG': 'off', 'ORCH_HOME': sys.argv[2], **json.loads(sys.argv[3])}; "
        "sys.exit(supervise([sys.executable, '-c', sys.argv[1], *sys.argv[6:]], env, node_rank=int(sys.argv[5]), "
        "ips=('127.0.0.1',), "
        "probe_port=1, gpus=False, settings=json.loads(sys.argv[4])))"
    )
    import json

    argv = [rank, str(home), json.dumps(env or {}), json.dumps(settings), str(node_rank), *args]
    return subprocess.run([sys.executable, "-c", runner, *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": tmpdir} if tmpdir else None)  # fmt: skip


def check_snapshot(name: str, text: str) -> None:
    """Compare with tests/snapshots/<name>; UPDATE_SNAPSHOT=1 writes it (a missing snapshot is a failure)."""
    path = SNAPSHOTS / name
    if os.environ.get("UPDATE_SNAPSHOT") == "1":
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"snapshot {name} is missing; run UPDATE_SNAPSHOT=1 pytest, check it and commit it")
    assert text == path.read_text(), f"{name} changed; if intended, refresh with UPDATE_SNAPSHOT=1"


class Rehearsed(Exception):
    """Raised in place of a rehearsal by the `handed` fixture."""


@pytest.fixture
def handed(monkeypatch) -> list:
    """The batches the launch side or the head node hands driver.rehearse_batches (replaced: it raises Rehearsed,
    nothing is rehearsed), from this repository's recipes."""
    from orchestrator.rehearsal import driver

    built: list = []

    def capture(batches, *args, **kwargs):
        built.extend(batches)
        raise Rehearsed

    monkeypatch.setattr(driver, "rehearse_batches", capture)
    monkeypatch.chdir(ROOT)
    return built


@pytest.fixture
def project(tmp_path):
    """A scratch project: a copy of recipes/; runs write outputs/ and sky_jobs/ there, not in the repo."""
    import shutil

    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    return tmp_path


def output_dir_of(result, project: Path) -> Path:
    """The run's output directory, as its `[orch] output:` line names it."""
    import re

    return project / re.search(r"^\[orch\] output: (\S+)$", result.stdout, re.M).group(1)


def loss_log(output_dir: Path) -> dict[int, float]:
    """{step: loss} as rank 0 logged it (orch/log.jsonl)."""
    import json

    rows = [json.loads(x) for x in (output_dir / "orch" / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="session")
def phi3_fsdp2_run(tmp_path_factory):
    """The demo's command, `orch run phi3_dpo_fsdp --local --nodes 2 --smoke` (FSDP2 over gloo, 8 steps, checkpoints
    at 4 and 8), run once for the tests that need an uninterrupted phi3 run: test_scaling.py checks it as the demo
    and resumes its checkpoint-4 at other shapes (which rewrites its output directory), test_faults.py's killed node
    compares its resumed steps with `losses`, read here, before any test touched it. Those tests share the xdist
    group "phi3_fsdp2_run", so one worker runs them and this run is made once."""
    import json
    from types import SimpleNamespace

    project = tmp_path_factory.mktemp("phi3-fsdp2-run")
    shutil.copytree(ROOT / "recipes", project / "recipes")
    result = orch("run", "phi3_dpo_fsdp", "--local", "--smoke", "--nodes", "2", cwd=project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output_dir = output_dir_of(result, project)
    report = json.loads((output_dir / "orch" / "rank0.json").read_text())
    return SimpleNamespace(result=result, project=project, output_dir=output_dir, losses=loss_log(output_dir),
                           report=report)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_qwen3():
    """The smoke runs' tiny Qwen3, the ALST recipe's family (4 heads, 2 KV heads, so 2 ranks split the heads;
    core/smoke.py), built once."""
    from orchestrator.core import smoke

    artifacts = smoke.plan("Qwen/Qwen3-8B", "sft")
    smoke.ensure(artifacts)
    return artifacts.dir / "model"


@pytest.fixture
def node_env():
    def make(nodes: int, gpus: int, rank: int, **extra: str) -> dict[str, str]:
        env = {
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "".join(f"10.0.0.{i + 1}\n" for i in range(nodes)),
            "SKYPILOT_NUM_NODES": str(nodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
            "TRL_TRAINER": "dpo",
            "TRL_CONFIG": "recipes/trl/phi3_dpo.yaml",
            "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_phi3.yaml",
            "GLOBAL_BATCH_SIZE": "64",
        }
        env.update(extra)
        return env

    return make


TIERS = ("unit", "cli", "e2e", "root")
"""Every test has one (its own marker, else its module's): pyproject.toml's markers say what each means."""
HEAVY_FIRST = {"root": 0, "e2e": 0, "cli": 1, "unit": 2}
"""The order the suite hands tests out in (pytest_collection_modifyitems)."""


def pytest_addoption(parser):
    parser.addoption(
        "--tier", default="", help="run only the tests of these tiers, comma-separated (unit,cli,e2e,root); default all"
    )


def _tiers_wanted(config) -> set[str]:
    return {t.strip() for t in config.getoption("--tier").split(",") if t.strip()}


def pytest_ignore_collect(collection_path, config):
    """With --tier, a test module whose text names none of the wanted tiers' markers (`mark.unit`, ...) holds no test
    of them (a test's tier is its own marker, its class's or its module's): it is not imported (`make test-fast`
    skipped importing the trainer smoke, load-memory, resume and Slurm modules, ~2.5 s of each worker's collection).
    None: pytest decides as usual."""
    wanted = _tiers_wanted(config)
    if not wanted or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text(encoding="utf-8", errors="replace")
    return True if not any(f"mark.{tier}" in text for tier in wanted) else None


def tier_of(item) -> str:
    """The closest tier marker: a test's own, else its class's, else its module's."""
    return next((mark.name for mark in item.iter_markers() if mark.name in TIERS), "")


def _xdist_groups(config, items):
    """`--dist loadgroup` keeps tests marked `xdist_group(name)` on one worker by suffixing their node ids with
    `@name`; pytest-xdist 3.8 writes the suffix to `item._nodeid`, which pytest 9 no longer reads (the id lives in
    `item._id`), so every group was silently spread over the workers: two SkyPilot beds and a Slurm cluster once ran
    at the same time and broke each other's munged. The same suffix, where pytest 9 reads it."""
    if not getattr(config.option, "loadgroup", False) or not items or not hasattr(items[0], "_id"):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _xdist_groups(config, items)
    untiered = [item.nodeid for item in items if not tier_of(item)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered[:5])}")
    wanted = _tiers_wanted(config)
    if wanted - set(TIERS):
        raise pytest.UsageError(f"--tier {','.join(sorted(wanted))}: tiers are {', '.join(TIERS)}")
    if wanted:
        keep = [item for item in items if tier_of(item) in wanted]
        config.hook.pytest_deselected(items=[item for item in items if tier_of(item) not in wanted])
        items[:] = keep
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # CI runs as root: there, none is skipped
        skip = pytest.mark.skip(reason="needs root (network namespaces, cgroups, mounts, Slurm): CI runs as root")
        for item in items:
            if item.get_closest_marker("root"):
                item.add_marker(skip)
    # the heavy tiers first (a stable sort: each module's order kept): `--dist loadgroup` hands tests to whichever
    # worker is free in this order, so the last ones are milliseconds long and no worker idles while the other ends a
    # minute-long smoke run
    items.sort(key=lambda item: HEAVY_FIRST[tier_of(item)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """ORCH_TEST_CPU_DIR=DIR: each test's wall and CPU time (its setup, call and teardown; the worker's own and that of
    the processes it reaped) as a JSON line in DIR/<worker>.jsonl; `python bench/suite_cpu.py DIR` sums them by module.
    Daemons the worker never reaps (the SkyPilot bed's slurmd, API server, skylet and ranks) are not in it."""
    out = os.environ.get("ORCH_TEST_CPU_DIR")
    if not out:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime

    start, began = cpu(), time.time()
    yield
    record = {"id": item.nodeid, "start": began, "wall": time.time() - began, "cpu": cpu() - start}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    """Slurm's packages install in the background while the tests before test_slurm.py run (apt takes a minute)."""
    if any(item.module.__name__ in ("test_slurm", "test_sky_bed") for item in session.items):
        from slurm_cluster import start_install

        start_install()
