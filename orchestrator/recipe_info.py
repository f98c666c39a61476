"""What a recipe is, at a glance: trainer, strategy, model, GPUs (for `orch ls` and `orch show`)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator import parallel, yamlio
from orchestrator.node import PROFILES
from orchestrator.recipe import Recipe

PROFILE_STRATEGY = {
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "fsdp1": "fsdp1",
    "fsdp2": "fsdp2",
    "multi_gpu": "ddp",
    "single_gpu": "single-gpu",
}


@dataclass
class Summary:
    name: str
    trainer: str
    strategy: str
    model: str
    gpus: str
    nodes: int


def strategy(accelerate_config: dict) -> str:
    kind = str(accelerate_config.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        label = f"fsdp{(accelerate_config.get('fsdp_config') or {}).get('fsdp_version', 1)}"
    elif kind == "DEEPSPEED":
        ds = accelerate_config.get("deepspeed_config") or {}
        label = f"zero{ds.get('zero_stage', '?')}"
        if "none" not in (str(ds.get("offload_param_device", "none")), str(ds.get("offload_optimizer_device", "none"))):
            label += "-offload"
    elif kind == "MULTI_GPU":
        label = "ddp"
    else:
        label = kind.lower()
    sizes = parallel.declared(accelerate_config)
    if sizes and sizes.cp > 1:
        label += f"+cp{sizes.cp}"
    if sizes and sizes.sp > 1:
        label += f"+sp{sizes.sp}"
    return label


def summarize(recipe: Recipe) -> Summary:
    envs = recipe.envs
    value = envs["ACCELERATE_CONFIG"]
    if value in PROFILES:
        label = PROFILE_STRATEGY[value]
    else:
        try:
            label = strategy(yamlio.load(recipe.paired("ACCELERATE_CONFIG").read_text()) or {})
        except (OSError, yamlio.YAMLError):
            label = "?"
    if envs.get("VLLM_SERVER_NODES", "0") not in ("", "0"):
        label += "+vllm-server"
    try:
        model = (yamlio.load(recipe.paired("TRL_CONFIG").read_text()) or {}).get("model_name_or_path", "?")
    except (OSError, yamlio.YAMLError):
        model = "?"
    return Summary(recipe.name, recipe.trainer, label, str(model), recipe.accelerators or "-", recipe.num_nodes)
