"""What a recipe is, at a glance: trainer, strategy, model, GPUs (for `orch ls` and `orch show`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from orchestrator.core import accelerate_schema, configs, strategy
from orchestrator.core.errors import OrchError
from orchestrator.core.overrides import truthy
from orchestrator.launch.recipe import Recipe


class Summary(NamedTuple):
    name: str
    trainer: str
    strategy: str
    model: str
    gpus: str
    nodes: int


def summarize(recipe: Recipe, root: Path | None = None) -> Summary:
    """Read from the recipe's files (relative to its workdir, under `root` when given: orch's own recipes listed from
    another directory); a paired file that cannot be read shows as `?`."""
    workdir = root / recipe.workdir if root is not None else recipe.workdir
    try:
        accel, path = configs.load_accelerate(recipe.envs["ACCELERATE_CONFIG"], workdir)
        accelerate_schema.check_config(accel.raw, str(path))  # what `orch run` refuses has no strategy to show
        label = strategy.of(accel).label
    except OrchError:
        label = "?"
    if recipe.envs.get("VLLM_SERVER_NODES", "0") not in ("", "0"):
        label += "+vllm-server"
    try:
        trl = configs.load_yaml(workdir / recipe.envs["TRL_CONFIG"], "TRL config")
    except OrchError:
        trl = {}
    model = trl.get("model_name_or_path", "?")
    trainer = recipe.trainer
    if truthy(trl.get("use_peft", False)):  # LoRA, or QLoRA on 4-bit weights
        trainer += "+qlora" if truthy(trl.get("load_in_4bit", False)) else "+lora"
    try:
        gpus = str(recipe.gpus or "-")
    except OrchError:  # SkyPilot's candidates ([A100:8, H100:8]): `orch run --gpus` picks one
        asked = (recipe.task.get("resources") or {}).get("accelerators")
        if isinstance(asked, dict):
            asked = [f"{name}:{count}" for name, count in asked.items()]
        if not isinstance(asked, (list, tuple, set)):
            raise
        gpus = "|".join(map(str, asked))
    return Summary(recipe.name, trainer, label, str(model), gpus, recipe.num_nodes)
