"""Every launch-side check of a resolved launch, before anything is written, built or sent.

TRL's arguments (config keys and key=value overrides against trl_args.json), each rank's node plan computed
with the node's own code (`node.plan`, from the environment SkyPilot will set, placeholder IPs), and preflight
(memory only when GPUs are named).
"""

from __future__ import annotations

from typing import NamedTuple

from orchestrator.core import trl_schema
from orchestrator.launch import preflight
from orchestrator.launch.resolved import Launch
from orchestrator.node.plan import NodePlan, plan

PLACEHOLDER_TASK_ID = "$SKYPILOT_TASK_ID"


class Checked(NamedTuple):
    plans: list[NodePlan]
    """Every node rank's plan, rank 0 first."""
    memory: preflight.MemoryEstimate | None


def node_env(launch: Launch, rank: int, task_id: str, device: str) -> dict[str, str]:
    """The environment SkyPilot (or the local backend) gives node `rank`; IPs are placeholders."""
    env = {"SKYPILOT_TASK_ID": task_id, **launch.env()}
    if device == "cpu":
        env["ORCH_DEVICE"] = "cpu"
    env.update(
        SKYPILOT_NODE_IPS="".join(f"10.0.0.{i + 1}\n" for i in range(launch.nodes)),
        SKYPILOT_NUM_NODES=str(launch.nodes),
        SKYPILOT_NUM_GPUS_PER_NODE=str(launch.gpus.count if launch.gpus else 1),
        SKYPILOT_NODE_RANK=str(rank),
    )
    return env


def previews(launch: Launch, task_id: str = PLACEHOLDER_TASK_ID, device: str = "gpu") -> list[NodePlan]:
    """Each rank's plan, computed on the launch side by the code the node runs."""
    return [plan(node_env(launch, rank, task_id, device), *launch.paired) for rank in range(launch.nodes)]


def check_trl(launch: Launch) -> None:
    """TRL config keys and every key=value override exist for the trainer and have the right type."""
    trl_schema.check_config_keys(launch.trainer, launch.paired.trl, launch.envs["TRL_CONFIG"])
    trl_schema.check(launch.trainer, launch.overrides)


def check(launch: Launch, task_id: str = PLACEHOLDER_TASK_ID, device: str = "gpu") -> Checked:
    """All of it. Memory is estimated for GPU launches only (a local run is CPU processes)."""
    check_trl(launch)
    plans = previews(launch, task_id, device)
    trainers = launch.nodes - (1 if plans[-1].role == "vllm-server" else 0)
    memory = preflight.run(launch, trainers, gpus=launch.gpus if device == "gpu" else None)
    return Checked(plans, memory)
