"""Node side, inside every training process: TRL's trainer with orch's callbacks.

`accelerate launch --module orchestrator.train <trainer> --config <trl.yaml> [--key value ...]`

Arguments are parsed by TRL's own parser for that trainer (trl.scripts.<trainer>.make_parser), so a TRL
config that works with `trl <trainer> --config` works here. On top of TRL's script orch adds:
  - resume from the latest *complete* checkpoint in output_dir (a save is complete once orch marks it);
  - a per-rank report of what really ran (world size, rank, distributed type, samples seen) in
    <output_dir>/orch/, and one log line per logging step on the main process.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import sys
import time
from pathlib import Path

COMPLETE_MARKER = "orch_complete"
TRAINER_CLASSES = {
    "sft": "SFTTrainer",
    "dpo": "DPOTrainer",
    "grpo": "GRPOTrainer",
    "kto": "KTOTrainer",
    "reward": "RewardTrainer",
}


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


# Preference collators stack chosen rows then rejected rows into one input_ids batch: 2 rows per sample.
ROWS_PER_SAMPLE = {"dpo": 2, "reward": 2}


def _rows_in(inputs, trainer_name: str) -> int:
    """Samples in one micro-batch, from the leading dimension of its input_ids (GRPO: one per completion)."""
    for key in ("input_ids", "prompt_ids", "completion_ids"):
        value = inputs.get(key) if hasattr(inputs, "get") else None
        if value is not None and hasattr(value, "shape"):
            return int(value.shape[0]) // ROWS_PER_SAMPLE.get(trainer_name, 1)
    raise RuntimeError(f"orch cannot count samples in a {trainer_name} batch of {type(inputs).__name__}")


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TRAINER_CLASSES:
        raise SystemExit(f"usage: python -m orchestrator.train {{{','.join(TRAINER_CLASSES)}}} --config FILE [...]")
    trainer_name, rest = argv[0], argv[1:]

    import torch
    import trl
    from datasets import load_dataset
    from transformers import TrainerCallback

    parser = importlib.import_module(f"trl.scripts.{trainer_name}").make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(args=rest)

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

    output_dir = Path(training_args.output_dir)
    report_dir = output_dir / "orch"

    def dist():
        return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None

    class OrchCallback(TrainerCallback):
        """Marks complete checkpoints, counts optimizer steps run here, logs one line per logging step."""

        steps_run = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.steps_run += 1

        def on_save(self, args, state, control, **kwargs):
            if dist():
                dist().barrier()  # every rank has written its part of the checkpoint
            if state.is_local_process_zero:  # each node marks its own copy (node-local disks included)
                ckpt = output_dir / f"checkpoint-{state.global_step}"
                if ckpt.is_dir():
                    (ckpt / COMPLETE_MARKER).write_text(json.dumps({"step": state.global_step, "time": time.time()}))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            report_dir.mkdir(parents=True, exist_ok=True)
            with open(report_dir / "log.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            shown = " ".join(f"{k}={v:.6g}" for k, v in record.items() if k in ("loss", "learning_rate", "grad_norm"))
            if shown:
                print(f"[orch] step {state.global_step}/{state.max_steps} {shown}", flush=True)

    callback = OrchCallback()
    base = getattr(trl, TRAINER_CLASSES[trainer_name])

    class Trainer(base):
        orch_samples = 0

        def _load_optimizer_and_scheduler(self, checkpoint):
            # transformers maps the optimizer state to args.device, which is `cpu:0` for multi-process CPU
            # runs, and torch.load cannot restore to `cpu:0`: map it to plain `cpu` (what the state lives on).
            if not checkpoint or self.args.device.type != "cpu":
                return super()._load_optimizer_and_scheduler(checkpoint)
            original = torch.load

            def load(*args, **kwargs):
                if str(kwargs.get("map_location", "")).startswith("cpu"):
                    kwargs["map_location"] = "cpu"
                return original(*args, **kwargs)

            torch.load = load
            try:
                return super()._load_optimizer_and_scheduler(checkpoint)
            finally:
                torch.load = original

        def compute_loss(self, model, inputs, *args, **kwargs):
            # Counted here, after the trainer prepared the micro-batch (GRPO generates inside training_step).
            if model.training:
                self.orch_samples += _rows_in(inputs, trainer_name)
            return super().compute_loss(model, inputs, *args, **kwargs)

    kwargs = {}
    if trainer_name == "grpo":
        kwargs["reward_funcs"] = _reward_funcs(script_args.reward_funcs) + (
            [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
        )
    trainer = Trainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=trl.get_peft_config(model_args),
        callbacks=[callback],
        **kwargs,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # OrchCallback prints the step lines; full metrics in orch/log.jsonl
    acc = trainer.accelerator
    rank, world = acc.process_index, acc.num_processes
    resume = training_args.resume_from_checkpoint or latest_complete_checkpoint(output_dir)
    if dist() and not training_args.resume_from_checkpoint:
        # Every rank resumes from the same step: the newest one complete on every node.
        step = torch.tensor([int(resume.name.split("-")[1]) if resume else -1], dtype=torch.long)
        dist().all_reduce(step, op=torch.distributed.ReduceOp.MIN)
        resume = output_dir / f"checkpoint-{int(step.item())}" if step.item() >= 0 else None
    print(
        f"[orch] rank {rank}/{world}: distributed_type={acc.distributed_type.value} device={acc.device} "
        f"backend={dist().get_backend() if dist() else 'none'}" + (f" resuming from {resume}" if resume else ""),
        flush=True,
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    trainer.save_model(training_args.output_dir)

    local = torch.tensor([trainer.orch_samples], dtype=torch.long)
    total = local.clone()
    if dist():
        dist().all_reduce(total)
    report = {
        "rank": rank,
        "world_size": world,
        "distributed_type": acc.distributed_type.value,
        "backend": dist().get_backend() if dist() else None,
        "device": str(acc.device),
        "local_samples": int(local.item()),
        "total_samples": int(total.item()),
        "optimizer_steps": trainer.state.global_step,
        "optimizer_steps_this_run": callback.steps_run,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "resumed_from": str(resume) if resume else None,
        "pid": os.getpid(),
    }
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    # Leave together, then leave at once. Past the barrier no rank needs another; letting the interpreter tear
    # down gloo's C++ objects raced with the other ranks' teardown and aborted ~1 run in 10 on 2 CPU nodes
    # ("terminate called without an active exception"). Python's exit handlers (trackers) still run.
    if dist():
        dist().barrier()
    if hasattr(trainer, "end"):  # transformers >= 5.18: ends the trackers
        trainer.end()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)


if __name__ == "__main__":
    main()
