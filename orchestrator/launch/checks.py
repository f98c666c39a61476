"""Every launch-side check of a resolved launch, before anything is written, built or sent.

TRL's arguments (config keys and key=value overrides against trl_args.json), the node plans computed with the
node's own code (`node.plan`, from the environment SkyPilot will set, placeholder IPs) for the ranks that
differ (the head, node 1, the last node: every other rank is node 1 with its own --machine_rank, so the work is
linear in the node count), preflight (memory only when GPUs are named), and the rehearsal of the launch against
the owners' code (`rehearse`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from orchestrator.core import attention as attention_names
from orchestrator.core import bnb, fit, memory, slots, trl_schema
from orchestrator.core.accelerators import CPU, CUDA_CAPABILITY
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.core.overrides import truthy
from orchestrator.launch import preflight
from orchestrator.launch.resolved import Launch
from orchestrator.node import model_config
from orchestrator.node.plan import NodePlan, plan

PLACEHOLDER_TASK_ID = "RUN_ID"  # a valid run id (node/env.run_id) standing for the one the nodes get


class Checked(NamedTuple):
    plans: list[NodePlan]
    """The plans of the representative ranks (0, 1, the last), in rank order (plan.cluster.node_rank)."""
    memory: memory.Estimate | None


def placeholder_ips(nodes: int) -> str:
    """SKYPILOT_NODE_IPS as SkyPilot writes it (one per line, a newline at the end), for `nodes` nodes."""
    return "".join(f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}\n" for n in range(1, nodes + 1))


def representative_ranks(nodes: int) -> list[int]:
    return sorted({0, min(1, nodes - 1), nodes - 1})


def previews(launch: Launch, task_id: str = PLACEHOLDER_TASK_ID, device: str = "gpu") -> list[NodePlan]:
    """The plans of the representative ranks, computed on the launch side by the code the node runs."""
    env = {"SKYPILOT_TASK_ID": task_id, **launch.env()}
    if device == "cpu":
        env["ORCH_DEVICE"] = "cpu"
    env.update(
        SKYPILOT_NODE_IPS=placeholder_ips(launch.nodes),
        SKYPILOT_NUM_NODES=str(launch.nodes),
        SKYPILOT_NUM_GPUS_PER_NODE=str(launch.gpus.count if launch.gpus else 1),
    )
    return [
        plan({**env, "SKYPILOT_NODE_RANK": str(rank)}, *launch.paired) for rank in representative_ranks(launch.nodes)
    ]


def check_trl(launch: Launch) -> None:
    """TRL config keys and every key=value override exist for the trainer and have the right type."""
    trl_schema.check_config_keys(launch.trainer, launch.paired.trl, launch.envs["TRL_CONFIG"])
    trl_schema.check(launch.trainer, launch.overrides)
    # what the training entry loads first: an empty value (`model_name_or_path=`, an unset shell variable) would
    # pass every check that reads the value as a name and fail on the nodes
    if not str(launch.setting("model_name_or_path", "")).strip():
        raise OrchError(f"model_name_or_path is empty (from {launch.envs['TRL_CONFIG']} and the key=value overrides); "
                        "name a Hub model id or a directory the nodes can read")  # fmt: skip
    if not str(launch.setting("dataset_name", "")).strip() and not launch.setting("datasets"):
        raise OrchError(f"dataset_name is empty and no `datasets` mixture is set (from {launch.envs['TRL_CONFIG']} and "
                        "the key=value overrides); name a Hub dataset or a directory, or use --data FILE")  # fmt: skip


# What a setting needs on the nodes, which install uv.lock's orch[EXTRAS] as the recipe's setup names them
# (scripts/node-setup.sh): (setting, the values that need it, extra, what it brings). This machine's rehearsal may find
# the package installed (the dev extra has Trackio and bitsandbytes) or swap the setting off (Liger, vLLM: GPU-only).
BNB_OPTIMIZERS = bnb.OPTIMIZERS
NEEDS = (  # values None: a boolean setting, on (overrides.truthy: true, 1, yes, as TRL's parser reads it)
    ("use_liger_kernel", None, "gpu", "Liger's kernels"),
    ("use_vllm", None, "vllm", "vLLM"),
    ("load_in_4bit", None, "quant", "bitsandbytes"),
    ("load_in_8bit", None, "quant", "bitsandbytes"),
    ("optim", tuple(BNB_OPTIMIZERS), "quant", "bitsandbytes"),
    ("report_to", ("trackio",), "track", "Trackio"),
    ("attn_implementation", "hub", "gpu", "the Kernels Hub's loader (kernels)"),  # core/attention.may_need_hub
)


def node_extras(launch: Launch) -> list[str] | None:
    """The extras the recipe's setup installs on the nodes (`bash scripts/node-setup.sh EXTRAS`, `train` when it names
    none; `orch run --track` adds `track`), or None when its setup does not run node-setup.sh (an image of its own)."""
    setup = str(launch.recipe.task.get("setup") or "")
    if not re.search(r"node-setup\.sh\b", setup):
        return None
    extras = ["train"]  # in the setup's order
    for found in re.findall(r"node-setup\.sh[ \t]+([\w,]+)", setup):
        extras += [extra for extra in found.split(",") if extra and extra not in extras]
    if knob(launch.env(), "ORCH_TRACK", "off").lower() != "off" and "track" not in extras:
        extras.append("track")
    return extras


def check_extras(launch: Launch) -> None:
    """Each setting the nodes could not honour with the extras the recipe's setup installs: one line naming the extra.
    On the nodes themselves the rehearsal (`orch node --rehearse`) finds the same in their own environment."""
    extras = node_extras(launch)
    if extras is None:
        return
    if prequantized(launch) and "quant" not in extras:
        raise OrchError(f"{launch.setting('model_name_or_path')} is a bitsandbytes-quantised checkpoint: the nodes get "
                        "bitsandbytes with orch's quant extra, which the recipe's setup does not install "
                        f"({','.join(extras)}); add quant to the recipe's setup: bash scripts/node-setup.sh "
                        f"{','.join(extras)},quant")  # fmt: skip
    for key, values, extra, brings in NEEDS:
        value = launch.setting(key, "")
        words = [str(v) for v in value] if isinstance(value, list | tuple) else str(value).split()
        if values == "hub":  # flash_attention_N or org/name: uv.lock has no flash-attn, the ranks load a Hub kernel
            attention = attention_names.requested(launch.settings)[0]
            needs = attention if attention_names.may_need_hub(attention) else None
        elif values is None:
            needs = str(value).strip().lower() if truthy(value) else None  # as given: 1, yes, true (YAML's True)
        else:
            needs = next((w.lower() for w in words if w.lower() in values), None)
        if needs is None or extra in extras:
            continue
        how = "add --track, which installs it and logs every node's curves" if extra == "track" else (
            f"add {extra} to the recipe's setup: bash scripts/node-setup.sh {','.join(extras)},{extra}")
        raise OrchError(f"{key}={needs}: the nodes get {brings} with orch's {extra} extra, which the recipe's setup "
                        f"does not install ({','.join(extras)}); {how}, or drop {key}={needs}")  # fmt: skip


def prequantized(launch: Launch) -> str | None:
    """The TRL setting the launch's bitsandbytes-quantised checkpoint loads as (core/models.quantized), or None (and
    for a smoke run on the nodes, which trains the tiny model in its place)."""
    if knob(launch.envs, "ORCH_SMOKE", "off") == "on":
        return None
    return model_config.loads_as(str(launch.setting("model_name_or_path", "")), launch.setting("model_revision"))


def check_output_dir(launch: Launch) -> None:
    """On a cluster the nodes write the run to CHECKPOINT_ROOT/<run> (node/script.py), which replaces the TRL
    output_dir: an output_dir override would be dropped without a word (a local run honours it instead)."""
    root = launch.envs.get("CHECKPOINT_ROOT", "").strip()
    if root and "output_dir" in launch.overrides:
        raise OrchError(
            f"output_dir={launch.overrides['output_dir']}: on the nodes orch writes the run (checkpoints, resumption, "
            f"the final model) to CHECKPOINT_ROOT/<run>, {root}/<run>, in place of output_dir; move it with --env "
            "CHECKPOINT_ROOT=DIR, or drop output_dir="
        )


def rehearse(launch: Launch, checked: Checked) -> str:
    """Rehearse the launch's roles against the owners' code (rehearsal/): the line to print, or an OrchError
    naming the role, the owner that refused and the fix. Where the training stack is not installed here, says so
    (the head node rehearses in its setup, while the model downloads)."""
    from orchestrator.core import smoke
    from orchestrator.rehearsal import driver

    if not driver.stack_installed():
        return (
            "rehearsal: not here (the training stack is not installed: pip install '.[train]' to rehearse on this "
            "machine); the head node rehearses in its setup, while the model downloads"
        )
    model = str(launch.setting("model_name_or_path", ""))
    try:  # a model_type without a tiny model is refused here; one neither its config.json nor its name says is not
        family = model_config.family(model, launch.setting("model_revision"))
    except model_config.Unknown as exc:
        return f"rehearsal: not here ({exc}); the head node rehearses in its setup, where it reads config.json"
    loads = prequantized(launch)  # a bitsandbytes checkpoint: rehearsed as the setting that loads one like it
    quantized, bitsandbytes = driver.quantisation(launch.setting, loads)
    if (quantized or loads) and not driver.importable("bitsandbytes"):
        return (
            f"rehearsal: not here ({'a bitsandbytes checkpoint' if loads else 'load_in_4bit'} needs bitsandbytes: "
            "pip install '.[quant]' to rehearse on this machine); the head node rehearses in its setup, while the "
            "model downloads"
        )
    artifacts = smoke.plan(model, launch.trainer, family=family)
    from orchestrator.launch import data

    batch = driver.Batch(
        trainer=launch.trainer,
        roles=[driver.Role(name, p.argv, p.env, p.role) for name, p in driver.roles(checked.plans)],
        substitute=driver.substitutions(launch.trainer, launch.settings, artifacts.dir, driver.output_dir(),
                                        loads=loads, data_dir=data.sample_of(launch)),  # fmt: skip
        devices=launch.gpus_per_node,
        smoke=(artifacts.model_type, artifacts.trainer, str(artifacts.dir)),
        quantized=quantized,
        bitsandbytes=bitsandbytes,
        capability=CUDA_CAPABILITY.get(str(launch.gpus.name).upper()) if launch.gpus and launch.gpus.name else None,
    )
    (outcomes,) = driver.rehearse_batches([batch], launch.recipe.workdir)
    for outcome in outcomes:
        if not outcome.ok:
            fix = outcome.fix()
            raise OrchError(
                f"rehearsal of {launch.recipe.name}: the {outcome.role} would fail on its GPUs ({outcome.stage}: "
                f"{outcome.error})" + (f"; {fix}" if fix else "")
            )
    if launch.gpus is not None and launch.gpus.name != CPU and (why := _not_as_planned(launch, outcomes[0].facts)):
        raise OrchError(f"rehearsal of {launch.recipe.name}: {why}")
    return driver.summary(outcomes, launch.total_gpus, batch)


def _not_as_planned(launch: Launch, facts: dict) -> str | None:
    """What the owners' code made of the launch, against the strategy orch planned, checked and will report by (the
    Accelerate config's): one that differs ran where nobody looked (TRL's own fsdp argument turned a DDP recipe into
    FSDP; use_cpu=true trained GPU nodes on their CPUs), or None."""
    from orchestrator.core import strategy

    planned = strategy.of(launch.paired.accelerate)
    ran = str(facts.get("distributed_type", ""))
    expected = {"fsdp": "FSDP", "ddp": None}.get(planned.sharding, "DEEPSPEED")
    if ran == "MULTI_CPU" or (expected and ran != expected) or (not expected and ran in ("FSDP", "DEEPSPEED")):
        return (f"the owners' code would run {ran} where the Accelerate config ({launch.envs['ACCELERATE_CONFIG']}) "
                f"plans {planned.label}, by which orch estimated memory and will reshard and report; set the strategy "
                "in the Accelerate config alone")  # fmt: skip
    if facts.get("device", "cuda") != "cuda":
        return (f"the training processes would run on the {facts['device']} device, not the GPUs (the Accelerate "
                f"config {launch.envs['ACCELERATE_CONFIG']}'s use_cpu, or TRL's use_cpu): drop it")
    stage = facts.get("zero_stage")
    known = planned.kind.startswith("zero") and planned.kind[4:].isdigit()  # zero?: the stage is in a DeepSpeed JSON
    if known and stage is not None and f"zero{stage}" != planned.kind:
        return (f"DeepSpeed would run ZeRO-{stage} where the Accelerate config ({launch.envs['ACCELERATE_CONFIG']}) "
                f"plans {planned.label}: make its zero_stage and the DeepSpeed JSON's zero_optimization.stage agree")
    return None


def check(launch: Launch, task_id: str = PLACEHOLDER_TASK_ID, device: str = "gpu") -> Checked:
    """All of it. Memory is estimated for GPU launches only (a local run is CPU processes)."""
    check_trl(launch)
    slots.check_substitutions(launch.task(), launch.env())  # what SkyPilot will substitute as text, by its slot
    plans = previews(launch, task_id, device)
    trainers = launch.nodes - (1 if plans[-1].role == "vllm-server" else 0)
    memory = preflight.run(launch, trainers, gpus=launch.gpus if device == "gpu" else None)
    if memory is not None and (said := fit.beyond_positions(memory.setup, str(launch.setting("model_name_or_path")))):
        print(said, flush=True)
    if device == "gpu":  # a cloud launch: one row of the dataset and the attention kernel, asked of the Hub here
        from orchestrator.launch import datacheck, kernelcheck

        check_extras(launch)

        with kernelcheck.Check(launch) as kernel:  # its process asks the Hub while the data check runs
            for line in (datacheck.run(launch), kernel.result()):
                if line:
                    print(line, flush=True)
    return Checked(plans, memory)
