"""The quoting boundary (core/slots.py, issue 30 item 2), property-tested with Hypothesis: whatever string reaches a
slot, either orch refuses it with one line, or the resolved task, parsed back by SkyPilot itself, carries it as data
only (one field, the same text, nothing else changed), and a shell reads it as one word."""

import os
import shlex
import subprocess

import pytest
import sky
import yaml
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core import slots
from orchestrator.core.errors import OrchError

pytestmark = pytest.mark.unit
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
# arbitrary text, text made of each slot's own characters, and the injections found so far
ANY = st.one_of(
    st.text(max_size=80),
    st.from_regex(r"[a-z0-9.-]{3,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9._/:@+=,%-]{1,40}", fullmatch=True),
    st.sampled_from(['x", "source": "/etc', "docker:ubuntu;touch /tmp/pwn", "a$(touch x)", "a`id`", "My_Bucket!!",
                     "~root", "a b", "it's", "a\nb", "${HOME}", "$HOME", "a\\", '"', ""]),
)  # fmt: skip
RECIPE = yaml.safe_load((ROOT / "recipes" / "phi3_dpo_fsdp.yaml").read_text())


def _refused(slot: str, value: str) -> bool:
    try:
        slots.check(slot, value, "value")
    except OrchError as exc:
        assert str(exc).count("\n") == 0 and "use " in str(exc)
        return True
    return False


@SETTINGS
@given(value=ANY, slot=st.sampled_from(sorted(slots.SLOTS)))
def test_a_value_a_slot_takes_is_one_plain_shell_word(value, slot):
    if not _refused(slot, value) and value:
        assert shlex.quote(value) == value and shlex.split(value) == [value]


@SETTINGS
@given(value=ANY)
def test_a_bucket_name_reaches_skypilot_as_the_storage_name_and_nothing_else(value):
    """`--env CHECKPOINT_BUCKET=...`: SkyPilot substitutes it into the checkpoint mount as text (sky/task.py
    _fill_in_env_vars, on a JSON dump); what orch lets through parses back as that mount's name, and only that."""
    task = {**RECIPE, "envs": {**RECIPE["envs"], "CHECKPOINT_BUCKET": value}}
    try:
        slots.check_substitutions(task, task["envs"])
    except OrchError as exc:
        assert "CHECKPOINT_BUCKET" in str(exc) and "\n" not in str(exc)
        return
    parsed = sky.Task.from_yaml_config(task)
    (storage,) = parsed.storage_mounts.values()
    assert storage.name == value and storage.source is None
    assert set(parsed.storage_mounts) == set(RECIPE["file_mounts"]) and not parsed.file_mounts


@SETTINGS
@given(value=ANY)
def test_any_env_substituted_into_a_mount_path_stays_one_path(value):
    task = {**RECIPE, "envs": {**RECIPE["envs"], "WHERE": value},
            "file_mounts": {"/data/${WHERE}": "/tmp/src-$WHERE"}}  # fmt: skip
    try:
        slots.check_substitutions(task, task["envs"])
    except OrchError:
        return
    parsed = sky.Task.from_yaml_config(task)
    assert parsed.file_mounts == {f"/data/{value}": f"/tmp/src-{value}"}


@SETTINGS
@given(value=ANY)
def test_an_image_id_is_refused_or_one_word_in_the_nodes_docker_pull(value):
    """SkyPilot runs `docker pull <image>` unquoted on the nodes: what orch lets through is one word to bash."""
    from types import SimpleNamespace

    from orchestrator.launch import placement

    args = SimpleNamespace(spot=False, network_tier=None, infra=None, image_id=value, max_restarts=3, managed=False)
    launch = SimpleNamespace(recipe=SimpleNamespace(task={}), nodes=1)
    try:
        resources = placement.resources(args, launch)
    except OrchError:
        return
    if value:
        words = subprocess.run(["bash", "-c", f"printf '%s\\n' docker pull {resources['image_id']}"],
                               capture_output=True, text=True, env={"PATH": os.environ["PATH"]}).stdout  # fmt: skip
        assert words.splitlines() == ["docker", "pull", value]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="/\0"), min_size=1, max_size=40))
def test_a_data_file_with_any_name_is_staged_under_a_plain_one(name, tmp_path_factory, monkeypatch):
    """`--data "it's$(touch x).jsonl"`: SkyPilot rsyncs a mount's source through a shell here, so the file travels
    from a plain path in orch's cache (same bytes), never refused for its name."""
    from types import SimpleNamespace

    from orchestrator.launch import data

    if name in (".", "..") or len(name.encode()) > 200:
        return
    root = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("ORCH_CACHE_DIR", str(root / "cache"))
    path = root / f"{name}.jsonl"
    path.write_text('{"text": "hello"}\n')
    mounts = {}
    launch = SimpleNamespace(mounts={}, replace=lambda mounts: mounts)
    mounts = data.mount(launch, path)
    (source,) = mounts.values()
    assert slots.safe_path(source) and open(source).read() == '{"text": "hello"}\n'
    assert list(mounts) == [f"{data.DATA_MOUNT}/train.jsonl"]
