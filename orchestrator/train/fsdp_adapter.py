"""A PEFT adapter in FSDP2's sharded checkpoints, and a check that a checkpoint holds every trained parameter.

transformers' Trainer saves and loads an FSDP model with `adapter_only=True` whenever accelerate takes that argument
(transformers/distributed/fsdp.get_fsdp_ckpt_kwargs). For a sharded state dict accelerate then asks PEFT for the
adapter (`get_peft_model_state_dict`), and PEFT 0.21 selects the adapter's keys by walking `named_modules()`
(tuners_utils._get_tuner_state_dict_key_prefixes). Under accelerate's FSDP activation checkpointing those module names
hold `_checkpoint_wrapped_module.`, which the state dict's keys do not (torch's checkpoint wrapper strips it), so not
one key matches: every checkpoint of llama3_70b_qlora_fsdp held an empty model state (0 keys in
pytorch_model_fsdp_0), and a resume loaded it without an error. The adapter started over from its initialisation
while the optimizer state, keyed by parameter, resumed (measured: a smoke run's step 5 loss 5.786 after the resume,
5.471 uninterrupted).

`install()` answers that one case (PEFT, FSDP2, sharded state dict) with torch's own state-dict API instead: the
trained parameters of `get_model_state_dict` under their canonical names, as DTensor shards (so
torch.distributed.checkpoint reshards them at another world size), and the same keys on load. Every other case runs
accelerate's code unchanged. `unsaved()` reads a checkpoint's DCP metadata: a save that misses a trained parameter
stops the run at that save, and a resume from such a checkpoint (one written before this) is refused instead of
training from a lost adapter.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from orchestrator.train.checkpoints import is_peft

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate's save_fsdp_model: f"{FSDP_MODEL_NAME}_{model_index}"
WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")  # not in state-dict keys
_INSTALLED = "_orch_trained_only"


def canonical(name: str) -> str:
    """A parameter's name as its state-dict key: without the wrappers' module names."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def trained(model) -> list[str]:
    """The canonical names of the parameters the optimizer updates."""
    return [canonical(n) for n, p in model.named_parameters() if p.requires_grad]


def checked(trainer) -> bool:
    """Whether `unsaved` applies: FSDP2, whose parameters keep their names (DTensors). FSDP1 without use_orig_params
    trains flat parameters that no state-dict key names, and runs only on GPUs, so it is left out."""
    return bool(getattr(trainer, "is_fsdp_enabled", False) and getattr(trainer.accelerator, "is_fsdp2", False))


def unsaved(ckpt: Path, names: list[str]) -> list[str]:
    """The `names` that a checkpoint's sharded FSDP model state lacks ([] when it has no such state: DDP, DeepSpeed,
    a full state dict)."""
    where = ckpt / FSDP_MODEL_DIR
    if not (where / ".metadata").is_file():
        return []
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    return [n for n in names if f"model.{n}" not in keys]


def _sharded_adapter(model, adapter_only: bool, sd_options) -> bool:
    return bool(adapter_only and sd_options is not None and not sd_options.full_state_dict and is_peft(model))


def install() -> None:
    """Wrap accelerate's `_get_model_state_dict` and `_set_model_state_dict` (fsdp_utils), which its
    save_fsdp_model and load_fsdp_model call, for a PEFT model's sharded FSDP2 state (see the module's docstring)."""
    from accelerate.utils import fsdp_utils

    get, put = fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict
    if getattr(get, _INSTALLED, False):
        return

    @functools.wraps(get)
    def get_state(model, adapter_only=False, sd_options=None):
        if not _sharded_adapter(model, adapter_only, sd_options):
            return get(model, adapter_only=adapter_only, sd_options=sd_options)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        keep = set(trained(model))  # not the frozen base's buffers either (bitsandbytes' 4-bit quantization states)
        state = get_model_state_dict(model, options=replace(sd_options, ignore_frozen_params=True))
        return {key: value for key, value in state.items() if key in keep}

    @functools.wraps(put)
    def set_state(model, state_dict, adapter_only=False, sd_options=None):
        if not _sharded_adapter(model, adapter_only, sd_options):
            return put(model, state_dict, adapter_only=adapter_only, sd_options=sd_options)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        return set_model_state_dict(model, state_dict, options=replace(sd_options, strict=False))

    setattr(get_state, _INSTALLED, True)
    fsdp_utils._get_model_state_dict = get_state
    fsdp_utils._set_model_state_dict = set_state
