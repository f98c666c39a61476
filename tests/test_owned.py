"""orch deletes only directories it made for the run at hand (core/owned.py): `--fresh`, a run's reports, the
dashboard's cache, a failed pull, a node's live Trackio database. Each way a path can name something else (the
current directory, its parent, a home, a repository, a link, a directory without orch's marker or with another
run's) is tried here, through the owner's functions and through the CLI."""

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, orch

from orchestrator.core import owned
from orchestrator.core.errors import OrchError

pytestmark = pytest.mark.cli


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_claim_makes_a_marked_directory_and_leaves_existing_ones_unmarked(tmp_path):
    made = tmp_path / "a" / "b"
    assert owned.claim(made, "run-1") and owned.marker_run(made) == "run-1"
    assert owned.claim(made, "run-1")  # already this run's
    assert not owned.claim(made, "run-2") and owned.marker_run(made) == "run-1"  # another run's stays so
    mine = tmp_path / "mine"
    mine.mkdir()
    assert not owned.claim(mine, "run-1") and owned.marker_run(mine) is None
    link = tmp_path / "link"
    link.symlink_to(made)
    assert not owned.claim(link, "run-1") and owned.marker_run(link) is None  # a link is never read through
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".claim")] == []  # no temporary left


def test_remove_deletes_a_directory_made_for_the_run_without_following_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("data")
    run = tmp_path / "run"
    owned.claim(run, "r")
    (run / "checkpoint-1").mkdir()
    (run / "checkpoint-1" / "w.bin").write_bytes(b"x")
    (run / "checkpoint-1" / "to-outside").symlink_to(outside)
    (run / "top-link").symlink_to(outside / "keep.txt")
    assert owned.remove(run, "r", "test")
    assert not run.exists() and _files(outside) == ["keep.txt"]
    assert not owned.remove(run, "r", "test")  # nothing there: nothing to do


@pytest.mark.parametrize(
    "case, expected",
    [
        ("unmarked", r"carries no orch marker \(\.orch-run\).*rm -r "),
        ("other run", r"was made for run other, not r;"),
        ("symlink", r"is a symbolic link"),
        ("file", r"is not a directory"),
        ("marker is a link", r"carries no orch marker"),
        ("marker is not json", r"carries no orch marker"),
        ("marker too large", r"carries no orch marker"),
        ("repository", r"is a repository root"),
        ("cwd", r"is the current directory or holds it"),
        ("ancestor of cwd", r"is the current directory or holds it"),
        ("home", r"orch never deletes it"),
        ("workdir", r"orch never deletes it"),
    ],
)
def test_remove_refuses_what_orch_did_not_make_for_the_run(tmp_path, monkeypatch, case, expected):
    target = tmp_path / "target"
    owned.claim(target, "r")
    (target / "data.bin").write_bytes(b"precious")
    also = ()
    if case == "unmarked":
        (target / owned.MARKER).unlink()
    elif case == "other run":
        (target / owned.MARKER).write_text(json.dumps({"orch": 1, "run": "other"}))
    elif case == "symlink":
        target = tmp_path / "link"
        target.symlink_to(tmp_path / "target")
    elif case == "file":
        target = tmp_path / "target" / "data.bin"
    elif case == "marker is a link":
        (tmp_path / "forged").write_text(json.dumps({"orch": 1, "run": "r"}))
        (target / owned.MARKER).unlink()
        (target / owned.MARKER).symlink_to(tmp_path / "forged")
    elif case == "marker is not json":
        (target / owned.MARKER).write_text("run: r")
    elif case == "marker too large":
        (target / owned.MARKER).write_text(json.dumps({"orch": 1, "run": "r", "pad": "x" * 5000}))
    elif case == "repository":
        (target / ".git").mkdir()
    elif case == "cwd":
        monkeypatch.chdir(target)
    elif case == "ancestor of cwd":
        (target / "deeper").mkdir()
        monkeypatch.chdir(target / "deeper")
    elif case == "home":
        monkeypatch.setenv("HOME", str(target / "me"))
        (target / "me").mkdir()
    elif case == "workdir":
        also = (target / "project",)
    before = _files(tmp_path)
    with pytest.raises(OrchError, match=expected):
        owned.remove(target, "r", "test", also=also)
    assert _files(tmp_path) == before


def test_run_names_are_one_path_component():
    for bad in ("", ".", "..", "../x", "a/b", "x\0"):
        with pytest.raises(OrchError, match="cannot name a directory"):
            owned.check_name(bad)
    assert owned.check_name("phi3_dpo_fsdp-1a2b3c4d") == "phi3_dpo_fsdp-1a2b3c4d"


# ---------------------------------------------------------------- through the CLI


@pytest.fixture
def repo(tmp_path):
    """A project that is a repository, with files a wrong delete would take, in a folder of its own: the tests compare
    its parent's files before and after (tmp_path's parent held every earlier test's files in this worker, ~1 s a
    walk)."""
    import shutil

    project = tmp_path / "repo"
    shutil.copytree(ROOT / "recipes", project / "recipes")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "notes.txt").write_text("mine")
    return project


@pytest.mark.parametrize(
    "output_dir, expected",
    [
        (".", "output_dir=.: the directory the run starts in"),  # refused as a value (launch/checks.py), first
        ("", "output_dir= is empty"),
        ("..", "output_dir=..: above the directory the run starts in"),
        (".git/..", "output_dir=.git/..: the directory the run starts in"),
        ("notes.txt/..", "output_dir=notes.txt/..: the directory the run starts in"),
        ("{repo}", "--fresh: {repo} is the current directory or holds it; orch never deletes it"),
        ("{repo}/..", "--fresh: {repo}/.. is the current directory or holds it; orch never deletes it"),
        ("mine", "--fresh: mine carries no orch marker (.orch-run): it was made by hand or by an orch older than "
                 "markers; delete it by hand if you mean it (rm -r mine)"),
        ("linked", "--fresh: linked is a symbolic link"),
    ],
)  # fmt: skip
def test_fresh_never_deletes_what_orch_did_not_make(repo, output_dir, expected):
    output_dir, expected = output_dir.format(repo=repo), expected.format(repo=repo)
    (repo / "mine").mkdir()
    (repo / "mine" / "model.safetensors").write_bytes(b"weights")
    (repo / "linked").symlink_to(repo / "mine")
    before = _files(repo.parent)
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "--fresh", f"output_dir={output_dir}",
                  cwd=repo)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: ") and line.endswith(expected) or expected in line, line
    assert "deleting" not in result.stdout
    assert _files(repo.parent) == before  # nothing deleted, nothing written (no record, no lock, no output)


def test_fresh_of_another_runs_directory_is_refused_and_a_users_orch_folder_is_kept(repo):
    other = repo / "outputs" / "shared"
    owned.claim(other, "some-other-run")
    (other / "checkpoint-4").mkdir()
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "--fresh", "output_dir=outputs/shared",
                  cwd=repo)  # fmt: skip
    assert result.returncode == 2
    assert re.search(r"was made for run some-other-run, not qwen25_sft_ddp-\w+;", result.stderr), result.stderr
    assert (other / "checkpoint-4").is_dir()
    # training into another run's directory is the user's choice (the ranks check its checkpoints' settings), but
    # orch's reports never replace a folder of the user's named orch/
    (other / "orch").mkdir()
    (other / "orch" / "__init__.py").write_text("# the user's package\n")
    result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "output_dir=outputs/shared",
                  cwd=repo)  # fmt: skip
    assert result.returncode == 2
    assert "orch: error: the run's reports directory: outputs/shared/orch carries no orch marker" in result.stderr, (
        result.stderr)
    assert (other / "orch" / "__init__.py").read_text() == "# the user's package\n"


def test_a_run_never_writes_among_files_it_did_not_make(repo):
    """The final model (README.md, config.json, model.safetensors, the tokenizer's files) goes to the top of
    output_dir and transformers rotates checkpoint-* folders there: a directory holding anything else is refused
    before anything is written, the repository itself above all (its README.md was overwritten by a model card)."""
    (repo / "README.md").write_text("# my project\n")
    (repo / "mine").mkdir()
    (repo / "mine" / "checkpoint-4").mkdir()
    before = _files(repo.parent)
    refusals = ((".", "output_dir=.: the directory the run starts in"),
                (str(repo), f"output_dir={repo}: {repo} is the current directory or holds it"),
                ("mine", "output_dir=mine: mine holds files no orch run made (checkpoint-4/)"))  # fmt: skip
    for output_dir, expected in refusals:
        result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", f"output_dir={output_dir}",
                      cwd=repo)  # fmt: skip
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"orch: error: {expected}"), line
        assert _files(repo.parent) == before  # nothing written: no record, no lock, no model card


@pytest.mark.e2e
def test_a_run_takes_an_empty_directory_the_user_made_and_takes_it_again(repo):
    """An empty directory the user made is taken, stays unmarked (orch never deletes it: --fresh refuses it), and
    takes the run again, which resumes in it (its reports folder is orch's)."""
    (repo / "empty").mkdir()
    for steps in (1, 2):  # the second run resumes in it
        result = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--smoke", "output_dir=empty",
                      f"max_steps={steps}", cwd=repo)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming from " in result.stdout and (repo / "empty" / "checkpoint-2").is_dir()
    # the first run's (max_steps is part of a run's name): said before the launch, as the ranks will compare them
    assert re.search(r"^\[orch\] output: empty holds run qwen25_sft_ddp-\w+'s files: this run resumes from its "
                     r"checkpoints where their settings match", result.stdout, re.M), result.stdout[:3000]
    assert owned.marker_run(repo / "empty") is None


def test_fresh_deletes_the_runs_own_directory_and_says_what(tmp_path, capsys):
    from orchestrator.launch.backends.local import forget

    run = tmp_path / "run-1"
    owned.claim(run, "run-1")
    for step in (12, 8):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * 500_000)
    (run / "config.json").write_text("{}")
    forget(run, "run-1", tmp_path)
    out = capsys.readouterr().out
    assert re.search(
        r"^\[orch\] --fresh: deleting \S+: checkpoint-8, checkpoint-12 \(1.0 MB\) and the final model$", out, re.M
    )
    assert not run.exists()


def test_a_tampered_record_cannot_steer_the_dashboard_or_pull_outside_their_directories(project):
    cache = project / "cache"
    victim = project / "victim"
    victim.mkdir()
    (victim / "trackio").mkdir()
    (victim / "trackio" / "keep.db").write_text("x")
    jobs = project / "sky_jobs"
    jobs.mkdir()
    # the header names a run whose dashboard directory would be cache/dashboards/../../victim
    (jobs / "evil.yaml").write_text("# run: ../../victim\n# backend: local\n# output_dir: outputs/x\n\nname: x\n")
    for argv in (["dashboard", "evil", "--no-open"], ["pull", "evil"]):
        result = orch(*argv, cwd=project, env={"ORCH_CACHE_DIR": str(cache)})
        assert result.returncode == 2, result.stdout + result.stderr
        assert "sky_jobs/evil.yaml is not a readable run record (its header names run '../../victim'" in result.stderr
    assert (victim / "trackio" / "keep.db").read_text() == "x"
    for argv in (["pull", ""], ["logs", ""], ["cancel", ""], ["dashboard", ""]):
        result = orch(*argv, cwd=project)
        assert result.returncode == 2 and "an empty run name matches no run" in result.stderr, (argv, result.stderr)


def test_a_failed_pull_removes_only_the_directory_it_made(project, monkeypatch):
    from orchestrator.launch import records

    monkeypatch.chdir(project)
    records.write(records.new("r1", {"name": "x"}, "recipes/x.yaml", "orch run x", backend="local (1 node)",
                              output_dir="outputs/r1"))  # fmt: skip
    result = orch("pull", "r1", "models/new", cwd=project)
    assert result.returncode == 2 and "no final model in outputs/r1" in result.stderr, result.stderr
    assert not (project / "models").exists()  # models/ too: the pull made it
    (project / "models" / "empty").mkdir(parents=True)
    result = orch("pull", "r1", "models/empty", cwd=project)
    assert result.returncode == 2 and (project / "models" / "empty").is_dir()  # not made by the pull: kept


@pytest.mark.unit
def test_sizes_are_said_in_a_unit_that_keeps_their_digits():
    """A LoRA adapter of the smoke runs (29,712 bytes) was 'adapter_model.safetensors, F32, 0.0 MB'."""
    from orchestrator.core.final_model import size_words

    assert [size_words(n) for n in (29_712, 999_999, 1_000_001, 335_400_000, 140_200_000_000)] == [
        "29.7 kB", "1.0 MB", "1.0 MB", "335.4 MB", "140.2 GB"]  # fmt: skip


@pytest.mark.parametrize("run", ["qwen25_sft_ddp-1a2b3c4d", "r" * 128])
@pytest.mark.parametrize(("tmp", "base", "shown"), [
    ("/tmp", "/tmp", 24), ("/tmp/orch-test-tmp-abcdefgh", "/tmp/orch-test-tmp-abcdefgh", 16),
    ("/s/" + "t" * 36, "/s/" + "t" * 36, 4), ("/s/" + "t" * 41, "/s/" + "t" * 41, 0), ("/s/" + "t" * 42, "/tmp", 24),
])  # fmt: skip
def test_a_local_node_s_tmpdir_leaves_room_for_python_s_unix_sockets(run, tmp, base, shown, monkeypatch):
    """Python's multiprocessing makes AF_UNIX sockets under TMPDIR (pymp-<8>/listener-<8>, 32 bytes more; DataLoader
    workers hand tensors over through them), whose paths Linux caps at 107 bytes: a DataLoader with a worker failed
    with "AF_UNIX path too long" under a 90-byte TMPDIR. A local run's node TMPDIR fits for any run id (ids go up to
    128 characters) under any temporary directory: as much of the id as fits, and under one too long for even the
    hash, /tmp; two ids that share the name's first characters still get two directories."""
    import tempfile

    from orchestrator.launch.backends.local_nodes import scratch_dir

    monkeypatch.setattr(tempfile, "tempdir", tmp)
    out = Path("/home/someone/projects/my-fine-tuning-project/outputs") / run
    tmpdir = scratch_dir(run, out) / "node15" / "tmp"
    assert len(str(tmpdir).encode()) + len("/pymp-12345678/listener-12345678") <= 107, tmpdir
    assert str(tmpdir.parent.parent.parent) == base, tmpdir
    assert re.fullmatch(rf"orch-local-{run[:shown]}{'-' if shown else ''}[0-9a-f]{{8}}", tmpdir.parent.parent.name)
    assert scratch_dir(run, out) != scratch_dir(run + "x", out) != scratch_dir(run, out / "x")


def test_a_local_runs_node_directory_goes_with_the_run_and_never_takes_anothers(tmp_path, monkeypatch, request):
    """Each emulated node's home and TMPDIR live in one directory of the run's (launch/backends/local_nodes.py), made
    before the nodes start and removed when they end, failed or not: what a node leaves in temporary files (torch's
    elastic agent's torchelastic_* directory at every launch) goes with it. A killed attempt's directory is replaced
    (a stale checkpoint request there would make the next attempt save at once); one orch did not make is left."""
    import tempfile

    from orchestrator.launch.backends.local_nodes import node_envs, node_scratch, scratch_dir

    short = Path(tempfile.mkdtemp(prefix="t"))  # the session's TMPDIR: tmp_path is too long for the id in the name
    request.addfinalizer(lambda: shutil.rmtree(short))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch's inductor sets it once it has chosen one
    out, elsewhere = tmp_path / "a" / "outputs" / "r", tmp_path / "b" / "outputs" / "r"  # the run's output directory
    with node_scratch("run-1", 2, out) as scratch:
        assert scratch.parent == short and re.fullmatch(r"orch-local-run-1-[0-9a-f]{8}", scratch.name)
        assert owned.marker_run(scratch) == "run-1"
        envs = node_envs({}, 2, 1, task_id="run-1", port=1, barrier_port=2, scratch=scratch)
        assert [(e["ORCH_HOME"], e["TMPDIR"]) for e in envs] == [
            (str(scratch / f"node{r}"), str(scratch / f"node{r}" / "tmp")) for r in (0, 1)
        ]
        assert all(Path(e["TMPDIR"]).is_dir() for e in envs)
        assert envs[0]["TORCHINDUCTOR_CACHE_DIR"].startswith(str(short / "torchinductor_"))  # shared, as outside
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/cache/inductor")
        (kept,) = node_envs({}, 1, 1, task_id="run-1", port=1, barrier_port=2, scratch=scratch)
        assert kept["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"  # a cache set here is kept
        (scratch / "node1" / "tmp" / "torchelastic_x").mkdir()
    assert not scratch.exists()
    with pytest.raises(RuntimeError), node_scratch("run-1", 1, out) as scratch:
        (scratch / "node0" / "checkpoint-request").write_text("x")
        raise RuntimeError("a node failed")
    assert not scratch.exists()
    owned.claim(scratch, "run-1")  # an attempt killed before it removed its directory
    (scratch / "node0").mkdir()
    (scratch / "node0" / "checkpoint-request").write_text("stale")
    with node_scratch("run-1", 1, out) as again:
        assert not (again / "node0" / "checkpoint-request").exists() and (again / "node0" / "tmp").is_dir()
    # the same task run at once from another checkout (its own output directory, its own run lock): the same run id,
    # and neither takes the other's node directory, when it starts or when it ends
    with node_scratch("run-1", 1, out) as first:
        (first / "node0" / "checkpoint-request").write_text("the first run's")
        with node_scratch("run-1", 1, elsewhere) as second:
            assert second != first and (first / "node0" / "checkpoint-request").is_file()
        assert not second.exists() and (first / "node0" / "tmp").is_dir()
    assert not first.exists()
    mine = scratch_dir("run-2", out)
    mine.mkdir()
    (mine / "notes").write_text("mine")
    with pytest.raises(OrchError, match="run run-2's node directory: .*no orch marker"):
        with node_scratch("run-2", 1, out):
            pass
    assert (mine / "notes").read_text() == "mine"
