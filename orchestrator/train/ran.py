"""What ran, read from the trained model and the engine on each rank, never from a config: the sharding (FSDP's
version and DTensors, DeepSpeed's ZeRO stage and partitioned parameters, DDP's unused-parameter search), the PEFT
adapter, activation recomputation. The rank report (train/entry.py) and the rehearsal (rehearsal/role.py) hold them.
"""

from __future__ import annotations

from orchestrator.train import cpu_deepspeed, precision


def _reference_facts(trainer, sharded) -> dict:
    """DPO/KTO's frozen reference model (prepared by TRL): how many of its parameters `sharded(p)` holds."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return {}
    params = list(ref.parameters())
    return {"ref_sharded_params": sum(map(sharded, params)), "ref_params": len(params)}


def strategy_facts(trainer) -> dict:
    """What sharding really ran, read from the trained model and the engine, never from a config: FSDP's version,
    how many parameters are DTensors (sharded by fully_shard) and the state dict type; DeepSpeed's ZeRO stage and
    how many parameters ZeRO-3 partitioned; DDP's find_unused_parameters."""
    from accelerate.utils import DistributedType

    acc = trainer.accelerator
    params = list(trainer.model.parameters())
    if acc.distributed_type == DistributedType.FSDP:
        from torch.distributed.tensor import DTensor

        plugin = acc.state.fsdp_plugin
        facts = {
            "fsdp_version": plugin.fsdp_version,
            "sharded_params": sum(isinstance(p, DTensor) for p in params),
            "params": len(params),
            "state_dict_type": str(plugin.state_dict_type).rsplit(".", 1)[-1],
        }
        return {**facts, **_reference_facts(trainer, lambda p: isinstance(p, DTensor))}
    if acc.distributed_type == DistributedType.DEEPSPEED:
        engine = acc.deepspeed_engine_wrapped.engine if acc.deepspeed_engine_wrapped else trainer.model_wrapped
        facts = {
            "zero_stage": int(engine.zero_optimization_stage()),
            "sharded_params": sum(hasattr(p, "ds_tensor") for p in params),
            "params": len(params),
        }
        if acc.device.type == "cpu":  # the shared-memory op of DeepSpeed's CPU comm (train/cpu_deepspeed.py)
            facts["shm_comm"] = cpu_deepspeed.shm_comm_built()
        parallelism = getattr(acc, "parallelism_config", None)  # the live accelerator's, as the ranks built it
        if parallelism is not None and (parallelism.sp_size or 1) > 1:
            facts["sp_size"] = int(parallelism.sp_size)
        return {**facts, **_reference_facts(trainer, lambda p: hasattr(p, "ds_tensor"))}
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(trainer.model_wrapped, DistributedDataParallel):  # DDP: whether it searched for unused parameters
        # at every step (transformers turns it on for any model that is not a PreTrainedModel, a PeftModel included)
        return {"ddp_find_unused_parameters": bool(trainer.model_wrapped.find_unused_parameters)}
    return {}


def adapter_facts(model) -> dict | None:
    """PEFT, read from the trained model: how many parameters trained, of how many, and how many of its linear
    layers are bitsandbytes 4-bit ones (QLoRA); None when every parameter trained."""
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    if trainable == total:
        return None
    return {"trainable_params": trainable, "params": total, "linear4bit": precision.linear4bit(model)}


def recompute_facts(model) -> dict | None:
    """Activation checkpointing, read from the trained model: its decoder layers (transformers' GradientCheckpointing
    Layer), those whose gradient_checkpointing flag is on (transformers' gradient checkpointing) and torch's
    CheckpointWrapper modules (FSDP's activation checkpointing, which accelerate wraps around each layer); None when
    the backward recomputes nothing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers.modeling_layers import GradientCheckpointingLayer

    modules = list(model.modules())
    layers = [m for m in modules if isinstance(m, GradientCheckpointingLayer)]
    flagged = sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers)
    wrapped = sum(isinstance(m, CheckpointWrapper) for m in modules)  # FSDP2 renames its class (FSDPCheckpointWrapper)
    return {"layers": len(layers), "transformers": flagged, "fsdp": wrapped} if flagged or wrapped else None
