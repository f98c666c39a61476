"""Where a training process resumes, and what stops every rank before step 1.

The checkpoint is the newest that verifies on every node (train/checkpoints.choose_resume; newer damaged ones are
quarantined and said). Then, in this order, each a one-line refusal from the main process and exit 2 on every rank:
another strategy's checkpoint (train/reshape.other_format: DeepSpeed, FSDP and DDP load only their own), changed
training settings (train/run_config.compare, unless ORCH_RESUME_CHANGED=on), an FSDP checkpoint without a trained
parameter (train/fsdp_adapter.unsaved). A resume on another shape is said and, for DeepSpeed, converted
(train/reshape.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from orchestrator.core import resume_from
from orchestrator.core.errors import OrchError
from orchestrator.core.home import run_id
from orchestrator.core.knobs import knob
from orchestrator.train import fsdp_adapter, reshape, run_config
from orchestrator.train.checkpoints import choose_resume, quarantine
from orchestrator.train.collectives import max_over_ranks, min_over_ranks, node_of_process


def _refuse(acc, why: str) -> NoReturn:
    if acc.is_main_process:
        print(f"orch: error: {why}", flush=True)
    raise SystemExit(2)


def _lost_parameters(trainer, resume: Path) -> str:
    """Why the FSDP checkpoint cannot be resumed from when it lacks a trained parameter (one saved before
    train/fsdp_adapter: a LoRA adapter's FSDP checkpoints held none of it), "" otherwise. Loading it would train the
    adapter again from its initialisation, with the optimizer state of the trained one."""
    if not fsdp_adapter.checked(trainer):
        return ""
    names = fsdp_adapter.trained(trainer.model)
    lost = fsdp_adapter.unsaved(resume, names) if trainer.accelerator.is_main_process else []
    if not max_over_ranks(len(lost)):
        return ""
    return (f"{resume.name} holds no weights for {len(lost)} of the {len(names)} trained parameters "
            f"({lost[0] if lost else '...'}, ...), so a resume would train them again from their initialisation (FSDP "
            f"checkpoints of a PEFT adapter saved before orch wrote the adapter into them itself); "
            f"{run_config.start_over(resume)}")  # fmt: skip


def _reshape(trainer, resume: Path, now: dict, output_dir: Path) -> str:
    """A resume on another shape: said by the main process, and DeepSpeed's partitions converted (train/reshape.py)."""
    acc = trainer.accelerator
    was = run_config.saved_shape(resume)
    how = reshape.method(acc, resume, was.get("world"))
    line = run_config.shape_line(resume, was, now, how)
    if line and acc.is_main_process:
        print(line, flush=True)
    if how and acc.distributed_type.value == "DEEPSPEED":  # method() says how only where the partitions differ
        try:
            reshape.install(trainer, resume, run_id(os.environ) or output_dir.resolve().name, node_of_process()[0],
                            acc.is_local_main_process, max_over_ranks)  # fmt: skip
        except OrchError as exc:
            _refuse(acc, str(exc))
    return line


def checkpoint(trainer, callback, given: str | None, output_dir: Path) -> Path | None:
    """The checkpoint every rank resumes from (`given`: TRL's resume_from_checkpoint, else the newest complete one),
    after the checks above; None for a run from step 0. Sets callback.reshaped."""
    acc = trainer.accelerator
    resume = Path(given) if given else None
    if resume is not None and (why := resume_from.problem(str(given), resume)):
        _refuse(acc, why)
    if resume is None:
        node = node_of_process()[0]
        mine = node if acc.is_local_main_process else None  # node-local mains re-hash their share
        resume, skipped = choose_resume(output_dir, mine, min_over_ranks)
        if skipped and acc.is_main_process:
            listed = quarantine(output_dir, skipped)
            for ckpt, reason in skipped:
                print(
                    f"[orch] skipping {ckpt.name}: {reason}; quarantined in {listed}, resuming from "
                    f"{resume.name if resume else 'step 0'}",
                    flush=True,
                )
    if resume is None:
        return None
    shape = callback.run_config["shape"]
    if why := reshape.other_format(acc, resume, run_config.saved_shape(resume), shape):
        _refuse(acc, why)  # its settings differ too, but the strategy is what to name
    try:
        said = run_config.compare(resume, callback.run_config, knob(os.environ, "ORCH_RESUME_CHANGED", "off") == "on")
    except OrchError as exc:
        _refuse(acc, str(exc))
    for line in said if acc.is_main_process else []:
        print(line, flush=True)
    if why := _lost_parameters(trainer, resume):
        _refuse(acc, why)
    callback.reshaped = _reshape(trainer, resume, shape, output_dir)
    return resume
