"""Run records (launch/records.py): the state enum reads every state word orch and SkyPilot write, and records written
by an earlier orch (commit e1a0e4e, before platform: and RunState) still read, answer every command, and still launch
with SkyPilot (tests/fixtures/records_e1a0e4e/: a local smoke run's record and output, a cluster run's record)."""

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
