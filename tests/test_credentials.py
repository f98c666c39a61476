"""Secrets never reach a file orch writes (issue 30, item 4): the masks of a run's output and of its record. What is
refused at the door (credential-shaped --env, overrides, values holding a secret) is in test_bad_input's table."""

import io
import sys

import pytest

from orchestrator.core import credentials
from orchestrator.launch import records

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-value-xyz"


@pytest.mark.parametrize("text", ["hf_abcdefghijklmnopqrstuvwxyzABCDEFGH", "sk-proj-abcdefghijklmnop1234",
                                  "ghp_abcdefghijklmnop1234abcd", "AKIAABCDEFGHIJKLMNOP",
                                  "-----BEGIN OPENSSH PRIVATE KEY-----", "xoxb-1234567890-abcdef"])  # fmt: skip
def test_credential_shapes_are_seen_and_masked(text):
    assert credentials.looks_secret("NOTE", text)
    assert text not in credentials.Mask()(f"token={text} here") and "here" in credentials.Mask()(f"x {text} here")


@pytest.mark.parametrize("text", ["hf_transfer", "hf_hub_download", "sk-learn", "learning_rate=1e-5",
                                  "Qwen/Qwen2.5-0.5B-Instruct", "ghp_", "AKIA1234"])  # fmt: skip
def test_ordinary_words_are_not_credentials(text):
    assert not credentials.looks_secret("NOTE", text) and credentials.Mask()(text) == text


def test_a_local_runs_output_and_log_mask_every_secret_value(tmp_path):
    """Whatever a node prints (a library echoing its environment, a traceback quoting a token) reaches run.log and
    the terminal masked: the run's secrets by value, credential-named envs, credential-shaped words."""
    from orchestrator.launch.backends.local import run_nodes

    sink = io.StringIO()
    script = 'echo "mine=$MY_HUB key=$WANDB_API_KEY shaped=ghp_abcdefghijklmnop1234"; echo "ValueError: bad $MY_HUB"'
    env = {"MY_HUB": SECRET, "WANDB_API_KEY": "0123456789abcdef"}
    result = run_nodes(script, [env], tmp_path, sink=sink, secrets=[SECRET])
    out = sink.getvalue()
    assert result.returncode == 0, out
    assert "mine=*** key=*** shaped=***" in out and SECRET not in out and "0123456789abcdef" not in out
    assert "ghp_abcdefghijklmnop1234" not in out


def test_a_nodes_relay_masks_what_its_environment_holds(monkeypatch):
    from orchestrator.node.supervise import _Relay

    mask = credentials.Mask(credentials.from_env({"HF_TOKEN": SECRET, "PATH": "/usr/bin"}))
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    relay = _Relay(io.StringIO(f"loading with token {SECRET}\nRuntimeError: 401 for {SECRET}\n"), cpu=True, mask=mask)
    relay.thread.join(5)
    printed = sys.stdout.getvalue()
    assert SECRET not in printed + "".join(relay.errors) and "token ***" in printed
    assert relay.errors == ["RuntimeError: 401 for ***"]


def test_a_record_masks_its_secrets_wherever_they_appear(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    record = records.new("r-1", {"run": "x", "secrets": {"MY_HUB": None}}, "x.yaml", "orch run x", secrets=[SECRET])
    record.set_state(records.RunState.FAILED_TO_LAUNCH, error=f"SkyPilot said: bad header Authorization {SECRET}")
    text = records.write(record).read_text()
    assert SECRET not in text and "Authorization ***" in text and "MY_HUB: null" in text
