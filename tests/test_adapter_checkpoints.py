"""A PEFT adapter in FSDP2's sharded checkpoints (train/fsdp_adapter.py): what the owners' code writes for it, what orch
writes instead, and the checks that a checkpoint without a trained parameter is never written or resumed from. The
runs themselves (QLoRA saved on 2 x 1, resumed on 1 x 1): tests/test_trainers_smoke.py (RESHAPED)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from orchestrator.train import fsdp_adapter


def model_state(ckpt: Path, names: list[str]) -> Path:
    """A checkpoint's sharded model state as accelerate's save_fsdp_model writes it (one process, no group)."""
    dcp.save({"model": {name: torch.ones(2) for name in names}}, checkpoint_id=ckpt / fsdp_adapter.FSDP_MODEL_DIR)
    return ckpt


@pytest.mark.unit
def test_unsaved_names_what_a_checkpoints_model_state_lacks(tmp_path):
    ckpt = model_state(tmp_path / "checkpoint-4", ["layer.lora_A.default.weight"])
    assert fsdp_adapter.unsaved(ckpt, ["layer.lora_A.default.weight", "layer.lora_B.default.weight"]) == [
        "layer.lora_B.default.weight"
    ]
    assert fsdp_adapter.unsaved(model_state(tmp_path / "checkpoint-8", []), ["w"]) == ["w"]  # what orch found
    assert fsdp_adapter.unsaved(tmp_path / "checkpoint-12", ["w"]) == []  # DDP, DeepSpeed: no sharded model state
    wrapped = "base_model.model.layers.0._checkpoint_wrapped_module.mlp._fsdp_wrapped_module.up.lora_A.default.weight"
    assert fsdp_adapter.canonical(wrapped) == "base_model.model.layers.0.mlp.up.lora_A.default.weight"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.up(x)


def adapter_model():
    """A LoRA adapter on two blocks, each wrapped by torch's checkpoint_wrapper as accelerate's FSDP activation
    checkpointing wraps a decoder layer."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(Block(), Block()), LoraConfig(r=2, target_modules=["up"]))
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    return model


@pytest.mark.e2e
def test_the_owners_adapter_state_is_empty_under_activation_checkpointing_and_orchs_holds_the_adapter():
    """accelerate + PEFT return no key at all for this model (remove fsdp_adapter.install when they do); orch's
    wrapped helpers return the trained parameters, and load them back."""
    from accelerate.utils import fsdp_utils
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, options = adapter_model(), StateDictOptions(full_state_dict=False)
    owners = getattr(fsdp_utils._get_model_state_dict, "__wrapped__", fsdp_utils._get_model_state_dict)
    assert owners(model, adapter_only=True, sd_options=options) == {}

    fsdp_adapter.install()
    state = fsdp_utils._get_model_state_dict(model, adapter_only=True, sd_options=options)
    assert sorted(state) == sorted(fsdp_adapter.trained(model)) and len(state) == 4  # lora_A, lora_B of 2 blocks
    saved = {name: value.clone() + 1 for name, value in state.items()}
    fsdp_utils._set_model_state_dict(model, saved, adapter_only=True, sd_options=options)
    after = fsdp_utils._get_model_state_dict(model, adapter_only=True, sd_options=options)
    assert all(torch.equal(after[name], saved[name]) for name in saved)
    # a full model (no PEFT) still goes through accelerate's own code: every parameter
    plain = torch.nn.Linear(2, 2)
    assert sorted(fsdp_utils._get_model_state_dict(plain, adapter_only=True, sd_options=options)) == ["bias", "weight"]


@pytest.mark.e2e
def test_a_save_without_a_trained_parameter_stops_the_run_before_its_manifest(tmp_path):
    from orchestrator.train.callbacks import OrchCallback

    callback = OrchCallback(tmp_path)
    callback.trainer = SimpleNamespace(model=torch.nn.Linear(2, 2), is_fsdp_enabled=True,
                                       accelerator=SimpleNamespace(is_fsdp2=True))  # fmt: skip
    assert fsdp_adapter.checked(callback.trainer)
    assert not fsdp_adapter.checked(SimpleNamespace(is_fsdp_enabled=True, accelerator=SimpleNamespace(is_fsdp2=False)))
    model_state(tmp_path / "checkpoint-4", ["weight"])
    with pytest.raises(RuntimeError, match=r"^checkpoint-4 was saved without 1 of the 2 trained parameters"):
        callback._check_saved(SimpleNamespace(global_step=4, is_world_process_zero=True))
    model_state(tmp_path / "checkpoint-8", ["weight", "bias"])
    callback._check_saved(SimpleNamespace(global_step=8, is_world_process_zero=True))


@pytest.mark.e2e
def test_a_resume_from_a_checkpoint_without_a_trained_parameter_is_refused(tmp_path):
    """What a checkpoint written before train/fsdp_adapter holds (an empty model state): resuming from it would train
    the adapter again from its initialisation, so every rank stops before step 1 with this line."""
    from orchestrator.train import resumption

    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(model=model, is_fsdp_enabled=True,
                              accelerator=SimpleNamespace(is_fsdp2=True, is_main_process=True))  # fmt: skip
    old = model_state(tmp_path / "checkpoint-4", [])
    assert resumption._lost_parameters(trainer, old) == (
        "checkpoint-4 holds no weights for 2 of the 2 trained parameters (weight, ...), so a resume would train them "
        "again from their initialisation (FSDP checkpoints of a PEFT adapter saved before orch wrote the adapter into "
        f"them itself); start a new run in another output_dir, or empty this one ({tmp_path}: `orch run --fresh` "
        "deletes it when orch made it for this same run, rm -r otherwise)")
    assert resumption._lost_parameters(trainer, model_state(tmp_path / "checkpoint-8", ["weight", "bias"])) == ""
    with pytest.raises(SystemExit) as stopped:
        resumption._refuse(trainer.accelerator, "why")
    assert stopped.value.code == 2


@pytest.mark.e2e
def test_the_final_models_dtype_is_the_one_it_was_loaded_in_whatever_save_pretrained_wrote():
    """transformers' save_pretrained sets config.dtype to the name of the parameters' dtype; under mixed precision
    accelerate has upcast them to fp32 by then, so the config no longer says how the model was loaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from orchestrator.train import checkpoints

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    loaded = checkpoints.load_dtype(model)
    model.float()  # accelerate's fp32 master weights
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)  # a FULL_STATE_DICT checkpoint
    assert model.config.dtype == "float32"  # the owners' behaviour this guards against
    assert loaded == torch.bfloat16 and checkpoints.as_dtype(model.config.dtype) == torch.float32
    state = checkpoints.in_dtype(model.state_dict(), loaded)
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert checkpoints.in_dtype(model.state_dict(), "float32")["lm_head.weight"].dtype == torch.float32  # no raise
