"""What orch adds to TRL's trainer: a callback (complete-checkpoint markers, step lines, the loss log) and a mixin
(samples counted per rank, the CPU resume workaround)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from orchestrator.core import scaling, trainers
from orchestrator.core.home import SAVE_DONE, SAVE_REQUEST, orch_home, run_id
from orchestrator.core.knobs import knob
from orchestrator.core.precision import line as precision_line
from orchestrator.core.timeline import duration, time_to_first_step
from orchestrator.train import disk, divergence, fsdp_adapter, precision, run_config, schedule, spend, stragglers
from orchestrator.train.checkpoints import MANIFEST, mark_diverged, write_manifest
from orchestrator.train.collectives import dist, for_collective, gather_rows, max_over_ranks, node_of_process
from orchestrator.train.throughput import Meter, tokens_in

DEFAULT_SAVE_SECONDS = 60.0  # what the cost cap keeps for a checkpoint before one was timed here


def _rows_in(inputs, trainer_name: str) -> int:
    """Samples in one micro-batch, from the leading dimension of its input_ids (GRPO: one per completion)."""
    for key in ("input_ids", "prompt_ids", "completion_ids"):
        value = inputs.get(key) if hasattr(inputs, "get") else None
        if value is not None and hasattr(value, "shape"):
            return int(value.shape[0]) // trainers.spec(trainer_name).rows_per_sample  # a pair stacks 2 rows
    raise RuntimeError(f"orch cannot count samples in a {trainer_name} batch of {type(inputs).__name__}")


def save_request_path(env=os.environ) -> Path:
    """The file `orch node --checkpoint-now` creates on a node ($ORCH_HOME/checkpoint-request)."""
    return orch_home(env) / SAVE_REQUEST


class OrchCallback(TrainerCallback):
    """Marks complete checkpoints, counts optimizer steps run here, logs one line per logging step, and prints
    the time to the first step."""

    def __init__(self, output_dir: Path, timeline: dict[str, float] | None = None, progress=None):
        self.output_dir = output_dir
        self.timeline = dict(timeline or {})
        self.progress = progress  # train/progress.py: what the node's watchdog reads (None: no watchdog)
        self.trainer = None  # set once built: its token count and models feed the meter
        self.meter = Meter(started=min(self.timeline.values()) if self.timeline else None)
        self.report_dir = output_dir / "orch"
        self.steps_run = 0
        self.cap = knob(os.environ, "ORCH_MAX_COST")  # dollars (--max-cost), refused on the launch side first
        self.saves: list[float] = []  # seconds each checkpoint took here: the cap keeps room for one more
        self.save_began = 0.0
        self.stopped = ""  # why the run stopped before max_steps (the cost cap), for the report
        self.tracker = None  # train/tracking.NodeTracker under --track
        self.run_config: dict | None = None  # train/run_config.of: written into every checkpoint
        # `orch node --checkpoint-now` (SkyPilot's preemption hook) asks for a checkpoint through a file on the node
        self.request = save_request_path() if knob(os.environ, "ORCH_SAVE_ON_REQUEST") == "on" else None
        self.memory = None  # train/loading.HostMemory: the rank's host memory at load and prepare
        self.attempt = ""  # this attempt's key in the run's spend record (train/spend.py)
        self.clock = stragglers.StepClock()  # this rank's step time and time blocked in collectives
        self.watch = stragglers.Watch()  # rank 0: the slowest rank and node, and who is named
        self.scaling: dict | None = None  # rank 0 of a multi-node run: its efficiency against one node (scaling.py)
        self.reshaped = ""  # what a resume at another shape said (train/run_config.shape_line)
        self.probe: precision.Probe | None = None  # the compute dtype at the first forward (train/precision.py)
        self.precision: dict | None = None  # what the first step really computed in and updated, for the report
        self.disk_warned = False  # this node said its disk fills before the end (train/disk.py)
        self.disk_said = False  # and what its first checkpoint took there
        self.cadence_said = False  # rank 0 said when the checkpoints come (train/schedule.cadence)
        self.eval_share: str | None = None  # and what evaluations take of the run (None: not judged yet)
        self.timed: list[list[float]] = []  # [began, ended] of the last optimizer steps (monotonic)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.memory is not None:
            self.memory.mark("prepare")
        if self.request is not None and state.is_local_process_zero:
            self.request.unlink(missing_ok=True)  # a request from before this start (a reused node) is stale
        trainer = self.trainer
        self.meter.begin(trainer.model if trainer else model, getattr(trainer, "ref_model", None), args.device)
        self.probe = precision.Probe(trainer.model if trainer else model)
        self._earlier_attempts(state)
        if stragglers.measured(args):
            stragglers.install(self.clock)
            stragglers.time_ddp(trainer.model_wrapped if trainer else model, self.clock)
        elif args.world_size > 1 and state.is_world_process_zero:
            print("[orch] note: stragglers are not measured on GPUs yet (NCCL collectives do not block the host)",
                  flush=True)  # fmt: skip
        if state.is_world_process_zero:
            print(f"[orch] training: up to step {state.max_steps}, logging every {args.logging_steps}", flush=True)
            if said := schedule.unlogged(args, state):
                print(said, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.run_config:
            return
        device = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else args.device.type.upper()
        per_rank = self.meter.latest.get("tokens_per_s_run", 0.0) / max(1, args.world_size)
        key = scaling.key(self.run_config, args.per_device_train_batch_size, device)
        self.scaling = scaling.compare_or_record(key, per_rank, self.run_config["shape"],
                                                 run_id(os.environ) or self.output_dir.resolve().name)  # fmt: skip
        if self.scaling:
            print(scaling.line(self.scaling), flush=True)

    def _earlier_attempts(self, state) -> None:
        """The run's earlier attempts, from its spend record (read by the main process, shared with every rank)."""
        meter = self.meter
        self.attempt = spend.attempt_id(meter.run_started)
        found = spend.earlier(self.output_dir, self.attempt) if state.is_world_process_zero else (0.0, 0.0, 0)
        shared = for_collective(list(found), torch.float64)
        if dist():
            dist().all_reduce(shared, op=torch.distributed.ReduceOp.MAX)
        dollars, seconds, count = (float(x) for x in shared.tolist())
        meter.earlier_usd, meter.attempts = dollars, int(count) + 1
        if count and state.is_world_process_zero:
            said = f"${dollars:,.2f} over {duration(seconds)}" if dollars else f"{duration(seconds)}"
            print(f"[orch] spend: {int(count)} earlier attempt(s) of this run, {said} (orch_spend.json); counted in "
                  "the cost cap and the summary", flush=True)  # fmt: skip

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.begin()
        self.timed = [*self.timed[-49:], [time.monotonic(), 0.0]]  # the step's own time: an evaluation comes after
        if self.steps_run == 0 and self.trainer is not None:  # the step this attempt resumed at held finite weights
            self.trainer.orch_guard.last_finite = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.end()
        if self.timed:
            self.timed[-1][1] = time.monotonic()
        self.steps_run += 1
        self.meter.stepped()
        if self.cap is not None and self.meter.price is not None and not control.should_training_stop:
            self._within_budget(state, control)
        if self.request is not None and not control.should_save:
            if max_over_ranks(int(self.request.exists())):
                control.should_save = True
                if state.is_world_process_zero:
                    print(f"[orch] checkpoint asked for (preemption notice): saving at step {state.global_step}",
                          flush=True)  # fmt: skip
        if control.should_save:
            self.save_began = time.time()
        if self.progress:  # DefaultFlowCallback ran first: control says whether a save or an evaluation follows
            busy = "save" if control.should_save else "eval" if control.should_evaluate else ""
            self.progress.stepped(state.global_step, busy)
        if self.steps_run == 1:
            self.timeline["first_step"] = time.time()
            if self.probe is not None and self.trainer is not None:
                self.precision = self.probe.facts(self.trainer.optimizer)
            if state.is_world_process_zero:
                print(f"[orch] time to first step: {time_to_first_step(self.timeline)}", flush=True)
                if said := precision_line(self.precision):
                    print(said, flush=True)

    def _within_budget(self, state, control) -> None:
        """Stop after a final checkpoint when the spend so far, one more step and one more save would cross the cap.
        Every rank decides the same (MAX over ranks of each one's verdict)."""
        meter, now = self.meter, time.time()
        times = meter.step_times
        step = (times[-1] - times[-2]) if len(times) >= 2 else now - meter.train_started
        save = max(self.saves) if self.saves else DEFAULT_SAVE_SECONDS
        spent = meter.spent(now - meter.run_started)  # every attempt of the run (train/spend.py)
        if not max_over_ranks(int(spent + meter.price * (step + save) / 3600 > self.cap)):
            return
        control.should_save = True
        control.should_training_stop = True
        attempts = f" over {meter.attempts} attempts" if meter.attempts > 1 else ""
        self.stopped = (
            f"cost cap: ${spent:,.2f} spent{attempts} at ${meter.price:,.2f}/h; one more step and a checkpoint "
            f"(~{step + save:.0f} s) would cross --max-cost ${self.cap:,.2f}"
        )
        if state.is_world_process_zero:
            print(f"[orch] stopping at step {state.global_step}: {self.stopped}; saving a last checkpoint", flush=True)

    def on_save(self, args, state, control, **kwargs):
        if self.save_began:
            self.saves.append(time.time() - self.save_began)
            self.save_began = 0.0
        if self.tracker:  # before the barrier: the manifests written after it list the copies whole
            self.tracker.copy_to(self.output_dir / f"checkpoint-{state.global_step}", self.output_dir)
        if dist():
            dist().barrier()  # every rank has written its part of the checkpoint
        if self.trainer is not None and fsdp_adapter.checked(self.trainer):
            self._check_saved(state)  # before any manifest: a checkpoint that lost a trained parameter never counts
        if state.is_local_process_zero:  # each node writes its manifest last (node-local disks included)
            ckpt = self.output_dir / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                node, nodes = node_of_process()
                if self.run_config:  # what it was trained with (train/run_config.py), each node its own copy
                    run_config.write(ckpt, self.run_config)
                write_manifest(ckpt, node, nodes, state.global_step)
        if self.request is not None and state.is_local_process_zero and self.request.exists():
            self.request.unlink(missing_ok=True)
            done = self.request.with_name(SAVE_DONE)
            done.write_text(f"{state.global_step} {self.output_dir / f'checkpoint-{state.global_step}'}\n")
        if self.progress:
            self.progress.idle()
        self._disk_after_save(args, state, control)

    def _disk_after_save(self, args, state, control) -> None:
        """Each node's disk against the saves to come (train/disk.py): every rank stops when one cannot hold the
        next; the first time one would fill later, that node says when. Not after the last save of a run that stops
        here (the cost cap's): none comes."""
        ckpt = self.output_dir / f"checkpoint-{state.global_step}"
        saves = [] if control.should_training_stop else schedule.saves(args, state)[1]
        node, _ = node_of_process()
        row, said = [float(node), 0.0, 0.0, 0.0, 0.0], ""
        if state.is_local_process_zero and ckpt.is_dir():
            disk.rotate_here(args, state)
            found = disk.measure(ckpt, args.save_total_limit)
            fills = found.fills_at(saves)
            if fills is not None and fills == saves[0]:
                row = [float(node), 1.0, float(found.size), float(found.free), float(found.kept)]
            elif fills is not None and not self.disk_warned:
                self.disk_warned, said = True, disk.warning(node, ckpt, found, saves, fills)
            elif not self.disk_said:  # this process's first save: what a checkpoint takes here
                said = disk.measured(node, ckpt, found, saves)
            self.disk_said = True
        rows = gather_rows(row)  # after it every node's manifest is written: one that sees node 0's shares its disk
        if said and (node == 0 or not (ckpt / MANIFEST.format(0)).is_file()):
            print(said, flush=True)
        if stopping := sorted(r for r in rows if r[1]):
            node_at, _, size, free, kept = stopping[0]
            full = disk.Disk(int(size), int(free), int(kept), args.save_total_limit or None)
            raise RuntimeError(disk.stop_words(int(node_at), saves[0], full, ckpt.name))

    def _check_saved(self, state) -> None:
        """Every rank stops when the sharded model state rank 0 sees lacks a trained parameter (train/fsdp_adapter)."""
        ckpt = self.output_dir / f"checkpoint-{state.global_step}"
        names = fsdp_adapter.trained(self.trainer.model)
        count = max_over_ranks(len(fsdp_adapter.unsaved(ckpt, names)) if state.is_world_process_zero else 0)
        if count:
            raise RuntimeError(
                f"{ckpt.name} was saved without {count} of the {len(names)} trained parameters in its "
                f"model state ({fsdp_adapter.FSDP_MODEL_DIR}): a resume from it would start them over"
            )

    def on_evaluate(self, args, state, control, **kwargs):
        if self.progress:
            self.progress.idle()
        if state.is_world_process_zero and self.eval_share is None:  # the first evaluation, once steps were timed
            self.eval_share = schedule.eval_share(args, state, self.timed)
            if self.eval_share:
                print(self.eval_share, flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        verdict = self._finite(args, state, logs)  # before the line, which still shows the step
        self._log(args, state, logs)
        if verdict and knob(os.environ, "ORCH_NONFINITE", "stop") == "stop":
            if state.is_world_process_zero:  # no resume starts from weights that may not be finite
                mark_diverged(Path(args.output_dir), self.trainer.orch_guard.last_finite, verdict)
            if dist():
                dist().barrier()  # written before any rank's exit stops the others
            raise divergence.DivergedError(verdict)  # every rank, at the same step
        if verdict and state.is_world_process_zero:
            print(f"[orch] warning: {verdict} (ORCH_NONFINITE=warn: training goes on)", flush=True)

    def _finite(self, args, state, logs) -> str:
        """At a training log (every rank is here), whether its gradients and loss are finite (train/divergence.py)."""
        if not logs or "loss" not in logs or self.trainer is None:
            return ""
        guard = self.trainer.orch_guard
        return guard.judge(state.global_step, logs, max_over_ranks(guard.take()), divergence.scaled(self.trainer),
                           args.learning_rate)  # fmt: skip

    def _log(self, args, state, logs) -> None:
        if not logs:
            return
        figures: dict = {}
        named: list[str] = []
        if "loss" in logs and self.trainer is not None:  # a training log: every rank is here (two all-reduces)
            self.meter.padding_excluded = self.trainer.orch_padding_excluded
            world = self.trainer.accelerator.num_processes
            total = for_collective([self.trainer.orch_tokens], torch.float64)
            figures = self.meter.sample(total, state.global_step, state.max_steps, world, dist())
            slowest, named = self._stragglers(args, state, total.device)
            figures.update(slowest)  # rank 0's: the meter's latest figures, for the report, too
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        record.update(figures)
        if self.tracker and "loss" in logs and self.trainer is not None:
            self.tracker.log(state.global_step, record, self.trainer.orch_tokens, dist(), time.time())
        if not state.is_world_process_zero:
            return
        if figures:  # a training log: this attempt's spend so far, next to the checkpoints
            spend.write(self.output_dir, self.attempt, self.meter.run_started, figures["elapsed_s"], self.meter.price)
        self.report_dir.mkdir(parents=True, exist_ok=True)
        name = getattr(self.trainer, "orch_trainer_name", "")
        with open(self.report_dir / "log.jsonl", "a") as fh:  # `orch status` reads the last (its METRIC: the trainer's)
            fh.write(json.dumps({**record, "max_steps": state.max_steps, "trainer": name}) + "\n")
        shown = " ".join(f"{k}={v:.6g}" for k, v in record.items() if k in trainers.PLAIN_METRICS)
        spec = trainers.SPECS.get(name)
        if shown and spec:  # how this trainer's training goes, in TRL's own words (a reward, an accuracy)
            shown += "".join(f" {k}={v:.4g}" for k, v in spec.headline(record))
        if "eval_loss" in record:  # an evaluation (eval_strategy): its loss and the trainer's measures, eval_-named
            measured = {k.removeprefix("eval_"): v for k, v in record.items() if k.startswith("eval_")}
            said = "".join(f" eval_{k}={v:.4g}" for k, v in spec.headline(measured)) if spec else ""
            print(f"[orch] eval at step {state.global_step}/{state.max_steps}: eval_loss={record['eval_loss']:.6g}"
                  f"{said}", flush=True)  # fmt: skip
        if shown:
            speed = f" | {self.meter.describe(figures)}" if figures else ""
            print(f"[orch] step {state.global_step}/{state.max_steps} {shown}{speed}", flush=True)
            for line in named:
                print(line, flush=True)
            if figures and self.steps_run <= args.logging_steps:
                counted = "non-padding" if self.meter.padding_excluded else "all (padding included)"
                mfu = f"; MFU {self.meter.peak_note}" if self.meter.peak_note else ""
                print(f"[orch] note: tok/s counts the {counted} tokens of every rank's batches{mfu}", flush=True)
            if "eta_s" in figures and not self.cadence_said:  # once the step time is known
                self.cadence_said = True
                strategy, saves = schedule.saves(args, state)
                if said := schedule.cadence(state.global_step, state.max_steps, strategy, saves, figures["eta_s"]):
                    print(said, flush=True)

    def _stragglers(self, args, state, device) -> tuple[dict, list[str]]:
        """Every rank's busy and blocked time since the last log (one all-reduce); rank 0 gets the slowest rank and
        node as figures, and the lines naming a straggler."""
        if not stragglers.measured(args):
            return {}, []
        node, _ = node_of_process()
        rows = stragglers.gather(self.clock, args.process_index, args.world_size, node, dist(), device)
        if not state.is_world_process_zero:
            return {}, []
        return self.watch.see(rows, state.global_step)

    def throughput(self) -> dict:
        """The run's figures for the rank report (the summary repeats them)."""
        latest = self.meter.latest
        keep = ("tokens", "tokens_per_s_run", "mfu_run", "elapsed_s", "spent_usd", "attempts")
        return {
            **{k: latest[k] for k in keep if k in latest},
            "padding_excluded": self.meter.padding_excluded,
            "mfu_note": self.meter.peak_note,
        }


def _load_to_plain_cpu(original):
    """transformers maps the optimizer state to args.device, which is `cpu:0` for multi-process CPU runs, and
    torch.load cannot restore to `cpu:0`: map it to plain `cpu`, where the state lives."""

    def load(*args, **kwargs):
        if str(kwargs.get("map_location", "")).startswith("cpu"):
            kwargs["map_location"] = "cpu"
        return original(*args, **kwargs)

    return load


class OrchTrainerMixin:
    """Mixed into TRL's trainer class: counts the samples each rank trains on; the CPU resume workaround; no step past
    max_steps on a resume."""

    orch_trainer_name = ""
    orch_samples = 0
    orch_load_dtype = None  # the dtype the model was loaded in, set by train/entry.build (checkpoints.load_dtype)
    orch_tokens = 0
    orch_padding_excluded = True

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not checkpoint or self.args.device.type != "cpu":
            return super()._load_optimizer_and_scheduler(checkpoint)
        original = torch.load
        torch.load = _load_to_plain_cpu(original)
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            torch.load = original

    def _run_epoch(self, *args, **kwargs):
        # transformers 5.17 checks max_steps only after an optimizer step: a run resumed from its last checkpoint
        # (global_step == max_steps, an epoch longer than max_steps) trained step max_steps + 1 and saved it (every
        # trainer; measured: SFT at max_steps=4 wrote checkpoint-5, GRPO and RLOO at 8 checkpoint-9). Nothing is left.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            if self.is_world_process_zero():
                step, last = self.state.global_step, self.state.max_steps
                print(f"[orch] resumed at step {step}, max_steps {last}: nothing left to train", flush=True)
            return None
        return super()._run_epoch(*args, **kwargs)

    @property
    def orch_guard(self) -> divergence.Guard:
        if "_orch_guard" not in self.__dict__:
            self._orch_guard = divergence.Guard()
        return self._orch_guard

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.orch_guard.see(loss)
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        # Counted here, after the trainer prepared the micro-batch (GRPO generates inside training_step).
        if model.training:
            self.orch_samples += _rows_in(inputs, self.orch_trainer_name)
            tokens, excluded = tokens_in(inputs)
            self.orch_tokens += tokens
            self.orch_padding_excluded &= excluded
        return super().compute_loss(model, inputs, *args, **kwargs)
