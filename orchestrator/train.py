"""Node side, inside every training process: TRL's trainer with orch's callbacks.

`accelerate launch --module orchestrator.train <trainer> --config <trl.yaml> [--key value ...]`

Arguments are parsed by TRL's own parser for that trainer (trl.scripts.<trainer>.make_parser), so a TRL
config that works with `trl <trainer> --config` works here. On top of TRL's script orch adds:
  - resume from the latest *complete* checkpoint in output_dir, the same step on every rank;
  - a per-rank report of what really ran (world size, rank, distributed type, samples seen) in
    <output_dir>/orch/, and one log line per logging step on the main process;
  - a final model in Hugging Face format: under FSDP the last save gathers a full state dict (transformers'
    `save_model` writes nothing with a sharded one), and the files written are checked and reported.

This module imports the training stack: only training processes and the rehearsal (`orchestrator.rehearse_role`)
import it, never the launch side.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import TrainerCallback

COMPLETE_MARKER = "orch_complete"
TRAINER_CLASSES = {
    "sft": "SFTTrainer",
    "dpo": "DPOTrainer",
    "grpo": "GRPOTrainer",
    "kto": "KTOTrainer",
    "reward": "RewardTrainer",
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin")
# Preference collators stack chosen rows then rejected rows into one input_ids batch: 2 rows per sample.
ROWS_PER_SAMPLE = {"dpo": 2, "reward": 2}


# ---------------------------------------------------------------- checkpoints and the final model


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


# ---------------------------------------------------------------- what orch adds to TRL's trainer


def _rows_in(inputs, trainer_name: str) -> int:
    """Samples in one micro-batch, from the leading dimension of its input_ids (GRPO: one per completion)."""
    for key in ("input_ids", "prompt_ids", "completion_ids"):
        value = inputs.get(key) if hasattr(inputs, "get") else None
        if value is not None and hasattr(value, "shape"):
            return int(value.shape[0]) // ROWS_PER_SAMPLE.get(trainer_name, 1)
    raise RuntimeError(f"orch cannot count samples in a {trainer_name} batch of {type(inputs).__name__}")


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


class OrchCallback(TrainerCallback):
    """Marks complete checkpoints, counts optimizer steps run here, logs one line per logging step."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.report_dir = output_dir / "orch"
        self.steps_run = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_run += 1

    def on_save(self, args, state, control, **kwargs):
        if _dist():
            _dist().barrier()  # every rank has written its part of the checkpoint
        if state.is_local_process_zero:  # each node marks its own copy (node-local disks included)
            ckpt = self.output_dir / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                (ckpt / COMPLETE_MARKER).write_text(json.dumps({"step": state.global_step, "time": time.time()}))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        self.report_dir.mkdir(parents=True, exist_ok=True)
        with open(self.report_dir / "log.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        shown = " ".join(f"{k}={v:.6g}" for k, v in record.items() if k in ("loss", "learning_rate", "grad_norm"))
        if shown:
            print(f"[orch] step {state.global_step}/{state.max_steps} {shown}", flush=True)


def _load_to_plain_cpu(original):
    """transformers maps the optimizer state to args.device, which is `cpu:0` for multi-process CPU runs, and
    torch.load cannot restore to `cpu:0`: map it to plain `cpu`, where the state lives."""

    def load(*args, **kwargs):
        if str(kwargs.get("map_location", "")).startswith("cpu"):
            kwargs["map_location"] = "cpu"
        return original(*args, **kwargs)

    return load


class OrchTrainerMixin:
    """Mixed into TRL's trainer class: counts the samples each rank trains on; the CPU resume workaround."""

    orch_trainer_name = ""
    orch_samples = 0

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not checkpoint or self.args.device.type != "cpu":
            return super()._load_optimizer_and_scheduler(checkpoint)
        original = torch.load
        torch.load = _load_to_plain_cpu(original)
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            torch.load = original

    def compute_loss(self, model, inputs, *args, **kwargs):
        # Counted here, after the trainer prepared the micro-batch (GRPO generates inside training_step).
        if model.training:
            self.orch_samples += _rows_in(inputs, self.orch_trainer_name)
        return super().compute_loss(model, inputs, *args, **kwargs)


# ---------------------------------------------------------------- parse and build, as TRL's scripts do


class Parsed(NamedTuple):
    trainer: str
    script_args: object
    training_args: object
    model_args: object
    dataset_args: object


def parse(argv: list[str]) -> Parsed:
    """`<trainer> --config FILE [--key value ...]` through TRL's own parser for that trainer."""
    if not argv or argv[0] not in TRAINER_CLASSES:
        raise SystemExit(f"usage: python -m orchestrator.train {{{','.join(TRAINER_CLASSES)}}} --config FILE [...]")
    parser = importlib.import_module(f"trl.scripts.{argv[0]}").make_parser()
    return Parsed(argv[0], *parser.parse_args_and_config(args=argv[1:]))


def _reward_funcs(names):
    funcs = []
    for name in names or []:
        module, _, attr = name.rpartition(".")
        if module:
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            from trl import rewards

            funcs.append(getattr(rewards, name))
    return funcs


def trainer_class(trainer_name: str, *mixins: type) -> type:
    """TRL's trainer class for `trainer_name` with orch's mixin (and any others, first in the MRO)."""
    import trl

    base = getattr(trl, TRAINER_CLASSES[trainer_name])
    return type(f"Orch{base.__name__}", (*mixins, OrchTrainerMixin, base), {"orch_trainer_name": trainer_name})


def build(parsed: Parsed, callbacks: list, *mixins: type):
    """The trainer TRL's script for `parsed.trainer` would build (model loaded by the trainer from its id)."""
    import trl
    from datasets import load_dataset

    script_args, training_args, model_args, dataset_args = parsed[1:]
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    if dataset_args.datasets:
        dataset = trl.get_dataset(dataset_args)
    else:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    kwargs = {}
    if parsed.trainer == "grpo":
        kwargs["reward_funcs"] = _reward_funcs(script_args.reward_funcs) + (
            [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
        )
    trainer = trainer_class(parsed.trainer, *mixins)(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=trl.get_peft_config(model_args),
        callbacks=callbacks,
        **kwargs,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # OrchCallback prints the step lines; full metrics in orch/log.jsonl
    return trainer


# ---------------------------------------------------------------- the training process


def _min_over_ranks(step: int) -> int:
    if not _dist():
        return step
    value = torch.tensor([step], dtype=torch.long)
    _dist().all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return int(value.item())


def _report(trainer, callback: OrchCallback, resume: Path | None, final: dict | None) -> dict:
    acc = trainer.accelerator
    local = torch.tensor([trainer.orch_samples], dtype=torch.long)
    total = local.clone()
    if _dist():
        _dist().all_reduce(total)
    args = trainer.args
    return {
        "rank": acc.process_index,
        "world_size": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "backend": _dist().get_backend() if _dist() else None,
        "device": str(acc.device),
        "local_samples": int(local.item()),
        "total_samples": int(total.item()),
        "optimizer_steps": trainer.state.global_step,
        "optimizer_steps_this_run": callback.steps_run,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "resumed_from": str(resume) if resume else None,
        "final_model": final,
        "pid": os.getpid(),
    }


def _print_final(final: dict | None) -> None:
    if final is None:
        return
    if final["loadable"]:
        print(
            f"[orch] final model: {final['path']} ({', '.join(final['weights'])}, {final['bytes'] / 1e6:.1f} MB; "
            "transformers' from_pretrained loads it)",
            flush=True,
        )
    else:
        print(f"[orch] final model: NOT written in Hugging Face format in {final['path']}", flush=True)


def _leave(trainer) -> None:
    """Leave together, then leave at once. Past the barrier no rank needs another; letting the interpreter tear
    down gloo's C++ objects raced with the other ranks' teardown and aborted ~1 run in 10 on 2 CPU nodes
    ("terminate called without an active exception"). Python's exit handlers (trackers) still run."""
    if _dist():
        _dist().barrier()
    if hasattr(trainer, "end"):  # transformers >= 5.18: ends the trackers
        trainer.end()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parsed = parse(sys.argv[1:] if argv is None else argv)
    output_dir = Path(parsed.training_args.output_dir)
    callback = OrchCallback(output_dir)
    trainer = build(parsed, [callback])
    acc = trainer.accelerator
    resume = parsed.training_args.resume_from_checkpoint
    if not resume:
        resume = resume_choice(output_dir, latest_complete_checkpoint(output_dir), _min_over_ranks)
    print(
        f"[orch] rank {acc.process_index}/{acc.num_processes}: distributed_type={acc.distributed_type.value} "
        f"device={acc.device} backend={_dist().get_backend() if _dist() else 'none'}"
        + (f" resuming from {resume}" if resume else ""),
        flush=True,
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = save_final_model(trainer, parsed.training_args.output_dir)
    _print_final(final)
    report = _report(trainer, callback, Path(resume) if resume else None, final)
    callback.report_dir.mkdir(parents=True, exist_ok=True)
    (callback.report_dir / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=1))
    _leave(trainer)


if __name__ == "__main__":
    main()
