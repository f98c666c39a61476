"""Checkpoints and the final model, as the training process writes and finds them.

A checkpoint counts once `orch_complete` is written in it (after every rank saved); every start resumes from the
newest step complete on every node. The final model is written in Hugging Face format at the end.
"""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = "orch_complete"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin")


def latest_complete_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint-N with the highest N that orch marked complete; interrupted saves are skipped."""
    best: tuple[int, Path] | None = None
    if not output_dir.is_dir():
        return None
    for child in output_dir.iterdir():
        name = child.name
        if name.startswith("checkpoint-") and name[11:].isdigit() and (child / COMPLETE_MARKER).is_file():
            if best is None or int(name[11:]) > best[0]:
                best = (int(name[11:]), child)
    return best[1] if best else None


def resume_choice(output_dir: Path, local: Path | None, min_over_ranks) -> Path | None:
    """The checkpoint every rank resumes from: the newest step complete on every node.

    local: this rank's newest complete checkpoint; min_over_ranks(step) returns the smallest step any rank
    passed (-1 = none), a collective in a real run. Nodes with their own disks may hold different newest steps.
    """
    step = min_over_ranks(int(local.name.split("-")[1]) if local else -1)
    return output_dir / f"checkpoint-{step}" if step >= 0 else None


def final_model_files(output_dir: Path) -> dict:
    """What a finished run left for `from_pretrained`: a config and weights in Hugging Face format."""
    weights = sorted(p.name for p in output_dir.glob("*") if p.name in WEIGHT_FILES or p.name.startswith("model-"))
    has_config = (output_dir / "config.json").is_file() or (output_dir / "adapter_config.json").is_file()
    return {
        "path": str(output_dir),
        "weights": weights,
        "bytes": sum((output_dir / w).stat().st_size for w in weights),
        "loadable": has_config and bool(weights),
    }


def save_final_model(trainer, output_dir: str) -> dict | None:
    """Write the final model in Hugging Face format; the main process returns what it wrote (None elsewhere).

    Under FSDP transformers' `save_model` writes only when the plugin's state dict type is FULL_STATE_DICT; recipes
    keep SHARDED_STATE_DICT for fast checkpoints, so the last save switches to a full one (accelerate gathers it
    to rank 0 on CPU). Every rank must call this: gathering is a collective.
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        if "FULL_STATE_DICT" not in str(plugin.state_dict_type):
            plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(output_dir)
    if not trainer.args.should_save:
        return None
    return final_model_files(Path(output_dir))
