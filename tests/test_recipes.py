"""Every recipe is a valid SkyPilot task and names paired files that exist."""

import pytest
from conftest import ROOT

from orchestrator import recipe as recipes

TASKS = sorted((ROOT / "recipes").rglob("*.yaml"))
TASKS = [p for p in TASKS if p.parent == ROOT / "recipes"]  # task YAMLs; their configs sit in subfolders


def test_there_are_recipes():
    assert TASKS, "recipes/ holds no task YAML"


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_skypilot_accepts_recipe(path):
    sky = pytest.importorskip("sky")
    task = sky.Task.from_yaml(str(path))
    assert task.run and "orch node" in task.run
    assert task.num_nodes >= 1


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_recipe_header_shows_its_commands(path):
    head = path.read_text().split("\n\n")[0]
    assert "sky launch" in head and f"recipes/{path.name}" in head
    assert f"orch run {path.stem}" in head


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_paired_files_exist(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = recipes.load(str(path.relative_to(ROOT)))
    recipes.check_paired_files(recipe)
    assert recipe.trainer in ("sft", "dpo", "grpo", "kto", "reward")
