"""core/sky_schema.py remembers a task that passed SkyPilot's schema (so that `orch ls` need not import jsonschema),
and never lets that memory pass a task or a schema it has not checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from orchestrator.core import sky_schema
from orchestrator.core.errors import OrchError

pytestmark = pytest.mark.unit

TASK = {"num_nodes": 2, "resources": {"accelerators": "A100:8"}, "envs": {"GLOBAL_BATCH_SIZE": 64}, "run": "true"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    for cached in (sky_schema.schema, sky_schema._schema_digest, sky_schema._validator):
        cached.cache_clear()
    yield tmp_path / "sky-schema"
    for cached in (sky_schema.schema, sky_schema._schema_digest, sky_schema._validator):
        cached.cache_clear()


def test_a_remembered_task_is_not_validated_again_in_a_new_process(cache):
    probe = (
        "import sys, json; from orchestrator.core import sky_schema; "
        f"sky_schema.check_task(json.loads({json.dumps(json.dumps(TASK))}), 'probe'); "
        "print('jsonschema' in sys.modules)"
    )
    seen = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True).stdout
        for _ in range(2)
    ]
    assert seen == ["True\n", "False\n"]
    assert len(list(cache.iterdir())) == 1


@pytest.mark.parametrize(
    "changed, field",
    [
        ({"num_nodes": "2"}, "num_nodes"),  # same text as the remembered 2, another JSON type
        ({"num_nodes": 2.5}, "num_nodes"),
        ({"file_mounts": ["a"]}, "file_mounts"),
        ({"run": "true", "setup": ["pip install x"]}, "setup"),
    ],
)
def test_a_changed_task_is_checked_again_and_a_failure_is_not_remembered(cache, changed, field):
    sky_schema.check_task(TASK, "good")
    remembered = set(cache.iterdir())
    for _ in range(2):
        with pytest.raises(OrchError, match=rf"^bad: {field}: .*\(SkyPilot's task schema\)"):
            sky_schema.check_task({**TASK, **changed}, "bad")
    assert set(cache.iterdir()) == remembered


def test_a_changed_schema_checks_a_remembered_task_again(cache, tmp_path, monkeypatch):
    sky_schema.check_task(TASK, "good")
    stricter = json.loads(sky_schema.SCHEMA.read_text())
    stricter["properties"]["num_nodes"]["maximum"] = 1
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(stricter))
    monkeypatch.setattr(sky_schema, "SCHEMA", path)
    for cached in (sky_schema.schema, sky_schema._schema_digest, sky_schema._validator):
        cached.cache_clear()
    with pytest.raises(OrchError, match=r"num_nodes: 2 is greater than the maximum of 1"):
        sky_schema.check_task(TASK, "good")


def test_an_unwritable_cache_still_checks(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ORCH_CACHE_DIR", str(blocker))  # a file where the directory would be
    sky_schema.check_task(TASK, "good")
    with pytest.raises(OrchError, match="num_nodes"):
        sky_schema.check_task({**TASK, "num_nodes": "x"}, "bad")


def test_a_task_that_cannot_be_hashed_canonically_is_checked_every_time(cache):
    """YAML keys of mixed types (1 beside num_nodes) have no sorted JSON form: nothing is remembered, and the check
    names the key as text instead of failing on it."""
    for _ in range(2):
        with pytest.raises(OrchError, match="^mixed: '1' is not a SkyPilot task field"):
            sky_schema.check_task({**TASK, 1: "x"}, "mixed")
    sky_schema.check_task({**TASK, "file_mounts": {1: "/a", "/b": "/c"}}, "mixed")  # SkyPilot's schema allows it
    assert not cache.exists()


PHI3 = ROOT / "recipes" / "phi3_dpo_fsdp.yaml"

# Each changes the default recipe's resources; SkyPilot's Resources validates them against its resources schema,
# which the task schema leaves as `{type: object}`. Checks outside any schema (a port range's text, an accelerator
# name against the catalog) are SkyPilot's at the optimizer (launch/backends/sky.to_task), not here: OUTSIDE lists
# those tried, so that a SkyPilot that moves one into its schema shows here.
OUTSIDE = {"memory_text", "disk_tier", "ports_text"}
RESOURCES = {
    "spot": {"use_spot": True},
    "spot_text": {"use_spot": "maybe"},
    "cpus_list": {"cpus": [1]},
    "cpus_plus": {"cpus": "8+"},
    "memory_text": {"memory": "lots of it"},  # outside the schema
    "typo": {"acelerators": "A100:8"},
    "int_key": {7: "x"},
    "hooks": {"hooks": ["a"]},
    "disk_text": {"disk_size": "big"},
    "disk_tier": {"disk_tier": "fastest"},  # outside the schema
    "ports_text": {"ports": "abc"},  # outside the schema
    "labels_list": {"labels": {"a": [1]}},
    "any_of": {"any_of": [{"gpus": "A100:8"}, {"accelerators": "H100:8"}]},
    "any_of_typo": {"any_of": [{"gpus": "A100:8"}, {"acelerators": "H100:8"}]},
    "ordered_spot": {"ordered": [{"use_spot": "no"}]},
    "job_recovery": {"job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": -1}},
}


# Each changes the default recipe's file mounts (its checkpoint bucket is /checkpoints: {name, mode}); SkyPilot's
# Task reads a string as a path, {store: volume, ...} as a volume, any other mapping as a bucket that Storage
# validates against its storage schema, and anything else not at all.
MOUNTS = {
    "mode_typo": {"/checkpoints": {"name": "b", "mode": "MOUNTCACHED"}},
    "mode_lower": {"/checkpoints": {"name": "b", "mode": "mount_cached"}},
    "field_typo": {"/checkpoints": {"nme": "b", "mode": "MOUNT"}},
    "persistent_text": {"/checkpoints": {"name": "b", "persistent": "yes"}},
    "store_typo": {"/checkpoints": {"name": "b", "store": "s4"}},
    "number": {"/x": 5},
    "list": {"/x": ["a"]},
    "path": {"/data": "./data"},
    "volume": {"/v": {"store": "volume", "name": "v1", "persistent": True}},
}


@pytest.mark.parametrize(
    "name", [f"resources.{n}" for n in RESOURCES] + [f"file_mounts.{n}" for n in MOUNTS] + ["gpus_alias", "gpus_both"]
)
def test_orchs_check_and_skypilots_agree(cache, name):
    import copy

    import sky
    import yaml

    task = yaml.safe_load(PHI3.read_text())
    resources = task["resources"]
    field, _, case = name.partition(".")
    if name == "gpus_alias":
        resources["gpus"] = resources.pop("accelerators")
    elif name == "gpus_both":
        resources["gpus"] = resources["accelerators"]
    elif field == "resources":
        resources.update(RESOURCES[case])
    else:
        task["file_mounts"].update(MOUNTS[case])
    try:
        sky.Task.from_yaml_config(copy.deepcopy(task))
        skypilot = None
    except Exception as exc:  # noqa: BLE001 - SkyPilot's own refusals come as several types
        skypilot = f"{type(exc).__name__}: {exc}"
    try:
        sky_schema.check_task(task, "recipe")
        orch = None
    except OrchError as exc:
        orch = str(exc)
    if case in OUTSIDE:
        assert orch is None and skypilot is not None, (orch, skypilot)
        return
    assert (orch is None) == (skypilot is None), (orch, skypilot)
    if skypilot is None:  # a pass is remembered and holds
        sky_schema.check_task(task, "recipe")


def test_a_recipe_with_skypilots_gpus_alias_is_read_as_its_accelerators(tmp_path):
    from orchestrator.launch import recipe as recipes

    text = PHI3.read_text()
    assert "\n  accelerators: A100:8\n" in text
    path = tmp_path / "alias.yaml"
    path.write_text(text.replace("\n  accelerators: A100:8\n", "\n  gpus: A100:8\n"))
    recipe = recipes.load(str(path))
    assert recipe.task["resources"]["accelerators"] == "A100:8" and "gpus" not in recipe.task["resources"]
    assert recipe.gpus is not None and recipe.gpus == recipes.load("phi3_dpo_fsdp").gpus


def test_the_ports_orch_keeps_off_are_the_ones_skypilots_nodes_hold():
    """knobs.NODE_PORTS (refused for MAIN_PROCESS_PORT, the barrier and a vLLM server; passed over by a local run's
    free ports) against SkyPilot's own constants and its `ray start` templates."""
    import re

    from sky.skylet import constants

    from orchestrator.core import knobs

    templates = "".join(p.read_text() for p in (Path(constants.__file__).parents[1] / "templates").glob("*.j2"))
    object_manager = {int(port) for port in re.findall(r"--object-manager-port=(\d+)", templates)}
    assert set(knobs.NODE_PORTS) == {22, constants.SKY_REMOTE_RAY_PORT, constants.SKY_REMOTE_RAY_DASHBOARD_PORT,
                                     constants.SKYLET_GRPC_PORT, *object_manager}  # fmt: skip
    assert object_manager == {8076}


def test_the_node_variables_a_task_env_may_not_set_are_skypilots_own():
    from sky.skylet import constants

    from orchestrator.core import knobs

    assert set(knobs.SKYPILOT_SETS) == {
        constants.SKYPILOT_NODE_RANK, constants.SKYPILOT_NODE_IPS, constants.SKYPILOT_NUM_NODES,
        constants.SKYPILOT_NUM_GPUS_PER_NODE, constants.SKYPILOT_SETUP_NUM_GPUS_PER_NODE, constants.TASK_ID_ENV_VAR,
    }  # fmt: skip
    assert knobs.set_by_launchers("SKYPILOT_DOCKER_USERNAME") == ""  # SkyPilot's own task setting for a registry
    assert knobs.set_by_launchers("RANK") == "" and knobs.set_by_launchers("RANK", in_process=True)
