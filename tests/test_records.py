"""Run records (launch/records.py): the state enum reads every state word orch and SkyPilot write, and records written
by an earlier orch (commit e1a0e4e, before platform: and RunState) still read, answer every command, and still launch
with SkyPilot (tests/fixtures/records_e1a0e4e/: a local smoke run's record and output, a cluster run's record)."""

import os
import shutil

import pytest
import sky
from conftest import ROOT
from fake_sky import FakeSky

from orchestrator import cli
from orchestrator.launch import records
from orchestrator.launch.records import RunState

pytestmark = pytest.mark.cli
OLD = ROOT / "tests" / "fixtures" / "records_e1a0e4e"


@pytest.mark.parametrize(
    "text, state, final",
    [
        ("running", RunState.RUNNING, False),
        ("succeeded", RunState.SUCCEEDED, True),
        ("failed (exit 1)", RunState.FAILED, True),
        ("failed to launch", RunState.FAILED_TO_LAUNCH, True),
        ("interrupted (SIGTERM)", RunState.INTERRUPTED, True),
        ("interrupted while launching", RunState.INTERRUPTED_LAUNCHING, True),
        ("stopped early (cost cap)", RunState.STOPPED_EARLY, True),
        ("launching", RunState.LAUNCHING, False),
        ("submitted", RunState.SUBMITTED, False),
        ("RECOVERING", RunState.RUNNING, False),
        ("FAILED_SETUP", RunState.FAILED, True),
        ("SUCCEEDED", RunState.SUCCEEDED, True),
        ("RECOVERING, 1 recovery", RunState.RUNNING, False),  # a managed job, with SkyPilot's count of recoveries
        ("SUCCEEDED, 2 recoveries", RunState.SUCCEEDED, True),
        ("cluster UP", RunState.RUNNING, False),
        ("cluster UP, IDLE at $65.54/h (stops after 10 idle min)", RunState.IDLE, False),
        ("cluster STOPPED", RunState.STOPPED, False),
        ("cluster down", RunState.DOWN, True),
        ("not found", RunState.NOT_FOUND, True),
        ("something else", RunState.UNKNOWN, False),
    ],
)
def test_every_state_word_reads_as_one_run_state(text, state, final):
    assert RunState.of(text) is state and state.final is final
    if state is not RunState.UNKNOWN and text.islower():
        assert RunState.of(state.text("why")) is state  # orch's own words come back


@pytest.fixture
def old_project(tmp_path, monkeypatch):
    shutil.copytree(OLD, tmp_path, dirs_exist_ok=True)
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_records_of_an_earlier_orch_answer_every_command(old_project, capsys, monkeypatch):
    local, cloud = records.find("qwen25_sft_ddp-55fe1fed"), records.find("phi3-dpo-fsdp-20261122-101500")
    assert (local.platform, local.state, cloud.platform, cloud.state) == (
        "local", RunState.SUCCEEDED, "sky", RunState.SUCCEEDED)  # fmt: skip
    fake = FakeSky(sky)
    monkeypatch.setitem(__import__("sys").modules, "sky", fake)
    assert cli.main(["status"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert " succeeded " in rows["qwen25_sft_ddp-55fe1fed"] and " 2/2 " in rows["qwen25_sft_ddp-55fe1fed"]
    assert " SUCCEEDED " in rows["phi3-dpo-fsdp-20261122-101500"] and fake.calls == []  # over: SkyPilot not asked
    assert cli.main(["logs", "qwen25_sft_ddp-55fe1fed"]) == 0
    assert "(node0) [orch] rank 0/1: distributed_type=NO" in capsys.readouterr().out
    assert cli.main(["logs", "phi3-dpo-fsdp-20261122-101500"]) == 0
    assert fake.calls[-1] == ("tail_logs", None, {"cluster_name": "phi3-dpo-fsdp-20261122-101500", "job_id": 7,
                                                  "follow": False})  # fmt: skip
    assert cli.main(["cancel", "qwen25_sft_ddp-55fe1fed"]) == 2  # a finished local run: nothing to cancel
    assert "is not running (succeeded)" in capsys.readouterr().err
    assert cli.main(["down", "phi3-dpo-fsdp-20261122-101500"]) == 0
    assert fake.names()[-1] == "down" and "# state: down" in (old_project / "sky_jobs" /
                                                               "phi3-dpo-fsdp-20261122-101500.yaml").read_text()


@pytest.mark.parametrize("name", ["qwen25_sft_ddp-55fe1fed", "phi3-dpo-fsdp-20261122-101500"])
def test_an_earlier_orchs_record_is_still_a_task_skypilot_launches(name):
    task = sky.Task.from_yaml(str(OLD / "sky_jobs" / f"{name}.yaml"))  # what `sky launch sky_jobs/<run>.yaml` reads
    assert task.run and "orch node" in task.run and task.num_nodes >= 1


# ---------------------------------------------------------------- identity: one name, one run (issue 30, item 5)


def test_two_cloud_launches_in_one_second_get_two_runs_and_two_records(project, monkeypatch, capsys):
    from fake_sky import FakeSky

    monkeypatch.chdir(project)
    fake = FakeSky(sky)
    monkeypatch.setitem(__import__("sys").modules, "sky", fake)
    monkeypatch.setattr(records.time, "strftime", lambda fmt, *a: "20261123-101500" if "H" in fmt else "x")
    argv = ["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--detach", "-y", "--no-rehearsal"]
    assert cli.main(argv) == 0 and cli.main(argv) == 0, capsys.readouterr().err
    files = sorted((project / "sky_jobs").glob("*.yaml"))
    clusters = [kw["cluster_name"] for name, _, kw in fake.calls if name == "launch"]
    assert len(files) == 2 and len(set(clusters)) == 2 and {f.stem for f in files} == set(clusters)
    assert all(f.stem.startswith("phi3-dpo-fsdp-20261123-101500-") for f in files)


def test_a_record_is_created_once_and_whole(project, monkeypatch):
    from orchestrator.core.errors import OrchError

    monkeypatch.chdir(project)
    first = records.new("r-1", {"run": "echo 1"}, "recipes/x.yaml", "orch run x")
    records.write(first, create=True)
    with pytest.raises(OrchError, match="already recorded"):
        records.write(records.new("r-1", {"run": "echo 2"}, "recipes/y.yaml", "orch run y"), create=True)
    assert records.read(project / "sky_jobs" / "r-1.yaml").task == {"run": "echo 1"}  # the first one's, untouched
    assert [p.name for p in (project / "sky_jobs").iterdir()] == ["r-1.yaml"]  # no temp file left


def test_commands_that_stop_or_relaunch_take_the_full_name_and_empty_names_match_nothing(old_project, capsys):
    assert cli.main(["cancel", "phi3-dpo"]) == 2
    assert "no run named exactly 'phi3-dpo'; this command takes the full name: phi3-dpo-fsdp-20261122-101500" in (
        capsys.readouterr().err)  # fmt: skip
    for argv in (["down", "phi3-dpo"], ["run", "--resume", "phi3-dpo", "-y"], ["cancel", ""], ["logs", ""],
                 ["pull", ""], ["status", ""], ["logs", " phi3-dpo-fsdp-20261122-101500"]):  # fmt: skip
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("orch: error:") == 1 and "Traceback" not in err, (argv, err)
    assert "# state: down" not in (old_project / "sky_jobs" / "phi3-dpo-fsdp-20261122-101500.yaml").read_text()
    assert cli.main(["logs", "qwen25"]) == 0  # reading accepts a unique prefix


def test_a_local_run_is_keyed_by_its_absolute_output_dir_wherever_its_workdir_is(tmp_path, monkeypatch):
    """A live local run whose recipe's workdir is not where orch runs is seen as live by `orch status`, never reaped."""
    from orchestrator.launch import runlock
    from orchestrator.launch.backends.local_backend import LocalBackend

    here, workdir = tmp_path / "here", tmp_path / "elsewhere" / "project"
    here.mkdir()
    workdir.mkdir(parents=True)
    monkeypatch.chdir(here)
    fd = runlock.acquire("r-1", workdir / "outputs" / ".." / "outputs" / "r-1", "orch run x")  # any spelling
    try:
        record = records.new("r-1", {"run": "x"}, "x.yaml", "orch run x", platform="local", state="running",
                             output_dir=str(workdir / "outputs" / "r-1"), token="not-a-live-token")  # fmt: skip
        records.write(record)
        assert LocalBackend().state(records.find("r-1")) == "running"
        monkeypatch.chdir(workdir)  # records are per directory: from another one this run is simply not listed
        assert not (workdir / "sky_jobs").exists()
    finally:
        os.close(fd)
    monkeypatch.chdir(here)
    assert LocalBackend().state(records.find("r-1")).startswith("interrupted (orch pid")  # its orch is gone now


@pytest.mark.parametrize("state, code", [("succeeded", 0), ("failed (exit 1)", 1), ("interrupted (SIGTERM)", 1)])
def test_the_logs_of_a_local_run_that_is_over_end_with_how_it_ended(old_project, capsys, state, code):
    """`orch logs RUN` of a local run: its run.log, then, when it did not succeed, its state and exit 1 (a failed
    cloud job's logs end the same way); a run whose orch is gone is not followed."""
    path = old_project / "sky_jobs" / "qwen25_sft_ddp-55fe1fed.yaml"
    path.write_text(path.read_text().replace("# state: succeeded", f"# state: {state}"))
    assert cli.main(["logs", "qwen25_sft_ddp-55fe1fed", "--follow"]) == code
    out = capsys.readouterr().out
    assert "(node0) [orch] rank 0/1: distributed_type=NO" in out
    last = out.rstrip().splitlines()[-1]
    assert (last == f"[orch] run qwen25_sft_ddp-55fe1fed: {state}") is (code == 1), last
