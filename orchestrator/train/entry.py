"""Node side, inside every training process: TRL's trainer with orch's callbacks.

`accelerate launch --module orchestrator.train <trainer> --config <trl.yaml> [--key value ...]`

Arguments are parsed by TRL's own parser for that trainer (trl.scripts.<trainer>.make_parser), so a TRL
config that works with `trl <trainer> --config` works here. On top of TRL's script orch adds:
  - resume from the latest *complete* checkpoint in output_dir, the same step on every rank;
  - a per-rank report of what really ran (world size, rank, distributed type, samples seen) in
    <output_dir>/orch/, and one log line per logging step on the main process;
  - a final model in Hugging Face format: under FSDP the last save gathers a full state dict (transformers'
    `save_model` writes nothing with a sharded one), and the files written are checked and reported.

This module imports the training stack: only training processes and the rehearsal (`orchestrator.rehearsal.role`)
import it, never the launch side.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from orchestrator.core import final_model, lines, trainers
from orchestrator.core.errors import retryable
from orchestrator.core.home import record_early_exit, run_id
from orchestrator.train import (
    cpu_deepspeed,
    cpu_fsdp,
    devices,
    fsdp_adapter,
    hub,
    hub_link,
    kept,
    loader_workers,
    loading,
    netcheck,
    ran,
    resumption,
    run_config,
    tracking,
)
from orchestrator.train.callbacks import OrchCallback, OrchTrainerMixin
from orchestrator.train.checkpoints import load_dtype, save_final_model
from orchestrator.train.collectives import dist, for_collective, node_of_process
from orchestrator.train.progress import Progress

# ---------------------------------------------------------------- parse and build, as TRL's scripts do


class Parsed(NamedTuple):
    trainer: str
    script_args: object
    training_args: object
    model_args: object
    dataset_args: object


def parse(argv: list[str]) -> Parsed:
    """`<trainer> --config FILE [--key value ...]` through TRL's own parser for that trainer."""
    if not argv or argv[0] not in trainers.SPECS:
        raise SystemExit(f"usage: python -m orchestrator.train {{{','.join(trainers.TRAINERS)}}} --config FILE [...]")
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

    base = getattr(trl, trainers.spec(trainer_name).trl_class)
    return type(f"Orch{base.__name__}", (*mixins, OrchTrainerMixin, base), {"orch_trainer_name": trainer_name})


def split(dataset, name: str, setting: str):
    """dataset[name], or a ValueError naming the splits the dataset has (TRL's scripts index it: `KeyError:
    'validation'` said nothing of which setting or which splits)."""
    if name in dataset:
        return dataset[name]
    have = ", ".join(dataset) or "none"
    raise ValueError(f"{setting}={name}: the dataset has no such split (its splits: {have}); set {setting} to one of "
                     "them")


def build(parsed: Parsed, callbacks: list, *mixins: type, memory: loading.HostMemory | None = None):
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
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)  # fmt: skip
    train_split = split(dataset, script_args.dataset_train_split, "dataset_train_split")
    evaluated = training_args.eval_strategy != "no"
    eval_split = split(dataset, script_args.dataset_test_split, "dataset_test_split") if evaluated else None
    kwargs = {}
    if trainers.spec(parsed.trainer).generates:  # GRPO, RLOO: the policy's completions are scored
        kwargs["reward_funcs"] = _reward_funcs(script_args.reward_funcs) + (
            [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
        )
    with loading.trained_model(model_args.model_name_or_path, memory):  # host memory around the model's load
        trainer = trainer_class(parsed.trainer, *mixins)(
            model=model_args.model_name_or_path,
            args=training_args,
            train_dataset=train_split,
            eval_dataset=eval_split,
            peft_config=trl.get_peft_config(model_args),
            quantization_config=trl.get_quantization_config(model_args),  # load_in_4bit: QLoRA, as TRL's scripts do
            callbacks=callbacks,
            **kwargs,
        )
    if script_args.ignore_bias_buffers:  # TRL's script argument (its DPO script acts on it): DDP skips bool buffers
        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    from transformers.trainer_callback import PrinterCallback

    trainer.orch_load_dtype = load_dtype(trainer.model)  # the final model's dtype (train/checkpoints.load_dtype)
    trainer.orch_rows_given = kept.count(train_split)  # the split as loaded
    trainer.remove_callback(PrinterCallback)  # OrchCallback prints the step lines; full metrics in orch/log.jsonl
    return trainer


# ---------------------------------------------------------------- the training process


def _report(trainer, callback: OrchCallback, resume: Path | None, final: dict | None, strategy: dict) -> dict:
    acc = trainer.accelerator
    local = for_collective([trainer.orch_samples], torch.long)
    total = local.clone()
    if dist():
        dist().all_reduce(total)
    # under sequence/context parallelism the ranks of one group share each sample (each holds a slice of it)
    parallelism = getattr(acc, "parallelism_config", None)
    sharing = (parallelism.sp_size or 1) * (parallelism.cp_size or 1) if parallelism is not None else 1
    args = trainer.args
    return {
        "rank": acc.process_index,
        "trainer": trainer.orch_trainer_name,
        "world_size": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "strategy": strategy,
        "adapter": ran.adapter_facts(trainer.model),
        "precision": callback.precision,  # the first step's compute dtype and what its optimizer updated
        "recompute": ran.recompute_facts(trainer.model),
        "backend": dist().get_backend() if dist() else None,
        "device": str(acc.device),
        # the attention the model's layers call, as transformers resolved it (a recipe's kernel can fall back)
        "attention": getattr(getattr(acc.unwrap_model(trainer.model), "config", None), "_attn_implementation", None),
        "train_dataset": type(trainer.train_dataset).__name__,  # IterableDataset where dataset_streaming streamed it
        "rows": trainer.orch_rows,  # the split's rows and those TRL kept (train/kept.py)
        "local_samples": int(local.item()),
        "total_samples": int(total.item()) // sharing,
        "data_parallel_ranks": acc.num_processes // sharing,
        "optimizer_steps": trainer.state.global_step,
        "optimizer_steps_this_run": callback.steps_run,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "resumed_from": str(resume) if resume else None,
        "reshaped": callback.reshaped,
        "final_model": final,
        "timeline": callback.timeline,
        "host_memory": callback.memory.report() if callback.memory else None,
        "throughput": callback.throughput(),
        "stopped": callback.stopped,
        "stragglers": callback.watch.report(),
        "scaling": callback.scaling,
        "pid": os.getpid(),
    }


def _print_final(final: dict | None) -> None:
    if final is None:
        return
    if final["loadable"]:
        files, loads = final_model.described(final)
        print(f"[orch] final model: {final['path']} ({files}; {loads})", flush=True)
    else:
        print(f"[orch] final model: NOT written in Hugging Face format in {final['path']}", flush=True)


def _leave(trainer) -> None:
    """Leave together, then leave at once. Past the barrier no rank needs another; letting the interpreter tear
    down gloo's C++ objects raced with the other ranks' teardown and aborted ~1 run in 10 on 2 CPU nodes
    ("terminate called without an active exception"). Python's exit handlers (trackers) still run."""
    if dist():
        dist().barrier()
    if hasattr(trainer, "end"):  # transformers >= 5.18: ends the trackers
        trainer.end()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)


_AT: dict = {}  # where this rank is: its output dir and trainer, for the early-exit record


def run() -> None:
    """main(), and a rank that leaves before training ended named as the cause. A finished rank never returns from
    main (`_leave` ends it with os._exit), so a clean exit reaching here (a sys.exit(0) or a return in training
    code, a library quitting) is an early one: the other ranks would then fail on its missing collectives and
    report a network error. It records itself where every node's launcher looks, says so and exits 1."""
    lines.whole_lines()  # the node's ranks share one pipe
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        code = exc.code or 0
    except Exception as exc:
        with contextlib.suppress(Exception):  # the rank's own error is what goes on
            _raised(exc)
        raise
    else:
        code = 0
    rank, node, step = _where()
    line = (f"rank {rank} (node {node}) exited with code {code} at step {step}, before training ended (a sys.exit "
            "or return in the training code?): the other ranks then lose it in their next collective")  # fmt: skip
    if _AT.get("output_dir") is not None:
        record_early_exit(_AT["output_dir"], rank, node, line, step=step)
    print(f"orch: error: {line}", flush=True)
    sys.stdout.flush()
    os._exit(1)


def _where() -> tuple[int, int, int]:
    """(this rank, its node, the last optimizer step it finished)."""
    trainer = _AT.get("trainer")
    step = trainer.state.global_step if trainer is not None else 0
    return int(os.environ.get("RANK", "0")), node_of_process()[0], step


def _raised(exc: Exception) -> None:
    """A rank that raised records itself where every node's launcher looks, as one that left early does: the ranks
    of the other nodes then fail on its missing collectives with a network error, which alone reads as the cluster's
    failure (exit 75: a managed job recovers on it, with no limit on recoveries, and would hit the same error again).
    Not a network or GPU failure of its own (core/errors.RETRYABLE): that one stays the cluster's."""
    kind, module = type(exc), type(exc).__module__
    name = kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"
    message = str(exc).strip().splitlines()
    error = f"{name}: {message[0]}" if message else name  # the traceback's last line, as the node quotes it
    if _AT.get("output_dir") is None or retryable(error):
        return
    rank, node, step = _where()
    record_early_exit(_AT["output_dir"], rank, node, f"rank {rank} (node {node}) failed at step {step}: {error}",
                      step=step)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    hub_link.mend_retries()  # before any request to the Hub: its retry after a refused connection works
    if cpu_deepspeed.wanted():  # before TRL's parser builds TrainingArguments, which may start DeepSpeed's comm
        cpu_deepspeed.skip_shm_comm()
    parsed = parse(sys.argv[1:] if argv is None else argv)
    devices.refuse(devices.gpu_problem())  # a GPU process that would train alone on the CPU
    if cpu_fsdp.wanted():
        cpu_fsdp.install()
    loading.install()  # ranks fed by FSDP2's broadcast hold no copy of the model meanwhile
    fsdp_adapter.install()  # a PEFT adapter's FSDP2 checkpoints hold the adapter
    loader_workers.install()  # a DataLoader worker that cannot send a batch ends, and its rank with it
    _AT["output_dir"] = output_dir = Path(parsed.training_args.output_dir)
    progress = Progress.from_env()
    if progress:
        progress.output_dir = str(output_dir.resolve())
    netcheck.run(parsed.training_args)  # sets up the process group (TrainingArguments' own way) and times it
    devices.refuse(devices.world_problem(parsed.training_args))  # the world torchrun started, read back
    callback = OrchCallback(output_dir, json.loads(os.environ.get("ORCH_TIMELINE") or "{}"), progress)
    memory = loading.HostMemory()  # this rank's resident set before the model, and its peak per phase
    trainer = build(parsed, [callback], memory=memory)
    memory.mark("build")
    callback.memory = memory  # marks "prepare" when training begins (the model sharded or wrapped)
    callback.trainer = trainer
    _AT["trainer"] = trainer
    callback.timeline["model_loaded"] = time.time()
    acc = trainer.accelerator
    kept.read_back(parsed.trainer, trainer, acc.is_main_process)  # the rows TRL left out: said, or an empty split
    if hub.repo() and acc.is_main_process:
        hub.prepare(hub.repo())
    node, nodes = node_of_process()
    callback.run_config = run_config.of(parsed, acc.num_processes, nodes)
    resume = resumption.checkpoint(trainer, callback, parsed.training_args.resume_from_checkpoint, output_dir)
    if project := tracking.project_of():
        run = run_id(os.environ) or output_dir.resolve().name
        callback.tracker = tracking.NodeTracker(project, run, node, nodes, acc.is_local_main_process)
        callback.tracker.start(output_dir, Path(resume) if resume else None)
    print(
        f"[orch] rank {acc.process_index}/{acc.num_processes}: distributed_type={acc.distributed_type.value} "
        f"device={acc.device} backend={dist().get_backend() if dist() else 'none'}"
        + (f" resuming from {resume}" if resume else ""),
        flush=True,
    )
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:  # a failed run's curves too, up to where it failed, for `orch dashboard` (the live one is the node's)
        if callback.tracker:
            callback.tracker.copy_to(output_dir)
    if progress:
        progress.busy("final")
    strategy = ran.strategy_facts(trainer)  # before the final save gathers
    final = save_final_model(trainer, parsed.training_args.output_dir)
    _print_final(final)
    report = _report(trainer, callback, Path(resume) if resume else None, final, strategy)
    if hub.repo() and final is not None and final["loadable"]:  # the main process: the one that wrote it
        report["pushed"] = hub.push(hub.repo(), output_dir)
        print(f"[orch] final model pushed: {report['pushed']['url']} ({len(report['pushed']['files'])} files, "
              f"commit {report['pushed']['commit'][:8]})", flush=True)  # fmt: skip
    callback.report_dir.mkdir(parents=True, exist_ok=True)
    (callback.report_dir / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=1))
    _leave(trainer)


if __name__ == "__main__":
    main()
