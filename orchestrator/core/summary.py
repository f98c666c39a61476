"""What a run really did, read back from the files its training processes wrote (per-rank reports in
<output_dir>/orch/, the loss log, the checkpoints): never from a config. The local backend prints it when its nodes
are done; on a cluster the head node does (node/exec.py), from the reports it can read."""

from __future__ import annotations

from pathlib import Path

from orchestrator.core import final_model, scaling, trainers
from orchestrator.core.precision import line as precision_line
from orchestrator.core.timeline import time_to_first_step


def ran_as(report: dict) -> str:
    """`FSDP2`, `DeepSpeed ZeRO-3`, `MULTI_CPU` (DDP): a rank's report, read back from the training process."""
    facts = report.get("strategy") or {}
    if "fsdp_version" in facts:
        return f"FSDP{facts['fsdp_version']}"
    if "zero_stage" in facts:
        sp = f" + Ulysses SP{facts['sp_size']}" if facts.get("sp_size") else ""
        return f"DeepSpeed ZeRO-{facts['zero_stage']}{sp}"
    return report["distributed_type"]


def spans(numbers: list[int]) -> str:
    """`0, 1` or `0-7, 16-23`: the ranks that reported, in runs of consecutive ones."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def sharding_line(ranks: list[dict]) -> str | None:
    """How many parameters each rank held sharded (DTensor under FSDP2, ZeRO-3 partitions), per the ranks."""
    facts = [r.get("strategy") or {} for r in ranks]
    if not facts or "params" not in facts[0]:
        return None
    head = facts[0]
    what = "DTensor" if "fsdp_version" in head else "ZeRO-3 partitions"
    sharded = min(f["sharded_params"] for f in facts)
    text = f"[orch] sharded: {sharded}/{head['params']} parameters on every rank ({what})"
    stage = head.get("zero_stage", 3)
    if stage < 3:
        states = "optimizer states and gradients" if stage == 2 else "optimizer states"
        text = f"[orch] sharded: {states} (ZeRO-{stage}); parameters replicated on every rank"
    if "ref_params" in head:
        text += f", reference model {min(f['ref_sharded_params'] for f in facts)}/{head['ref_params']}"
    if "state_dict_type" in head:
        text += f"; checkpoints as {head['state_dict_type']}"
    return text


def checkpoint_format(checkpoint: Path) -> str:
    """What the files say: FSDP's distributed checkpoint shards, DeepSpeed's per-rank ZeRO states, or nothing."""
    shards = sorted(checkpoint.glob("pytorch_model_fsdp_*/*.distcp"))
    if shards:
        return f" (sharded: {len(shards)} distcp shard file(s) in {shards[0].parent.name}/)"
    states = sorted(checkpoint.glob("global_step*/*optim_states.pt"))  # one per rank at every ZeRO stage
    if states:
        return f" (DeepSpeed: {len(states)} per-rank optimizer state file(s) in {states[0].parent.name}/)"
    return ""


def throughput_line(figures: dict) -> str | None:
    """Tokens/s over the run (all ranks), MFU (or why not), elapsed time and dollars, from rank 0's report."""
    if "tokens_per_s_run" not in figures:
        return None
    padding = "padding excluded" if figures.get("padding_excluded", True) else "padding included"
    parts = [f"{figures['tokens_per_s_run']:,.0f} tok/s over the run ({figures['tokens']:,} tokens, {padding})"]
    if "mfu_run" in figures:
        parts.append(f"MFU {100 * figures['mfu_run']:.1f}%")
    elif figures.get("mfu_note"):
        parts.append(f"MFU {figures['mfu_note']}")
    if "elapsed_s" in figures:
        parts.append(f"elapsed {figures['elapsed_s']:.0f} s")
    if "spent_usd" in figures:
        attempts = figures.get("attempts", 1)
        parts.append(f"${figures['spent_usd']:,.2f} spent" + (f" over {attempts} attempts" if attempts > 1 else ""))
    return "[orch] throughput: " + "; ".join(parts)


def straggler_lines(found: dict) -> list[str]:
    """The slowest rank at the last logging step, and every straggler named during the run (train/stragglers.py)."""
    if "slowest_rank" not in found:
        return []
    lines = [f"[orch] slowest at the end: rank {found['slowest_rank']} on node {found['slowest_node']}, "
             f"{found['slowest_ratio']:.2f}x the others' compute per step; median wait in collectives "
             f"{found['wait_s']:.3f} s per step"]  # fmt: skip
    named = found.get("named") or []
    first = f"; first: {named[0].removeprefix('[orch] ')}" if named else ""
    lines.append(f"[orch] stragglers named during the run: {len(named)}{first}")
    return lines


def stop_reason(output_dir: Path) -> str:
    """Why the run stopped before its last step (the cost cap), from rank 0's report; "" otherwise."""
    import json

    try:
        return json.loads((output_dir / "orch" / "rank0.json").read_text()).get("stopped") or ""
    except (OSError, ValueError):
        return ""


def summary(output_dir: Path) -> list[str]:
    """What really ran, from the per-rank reports the training processes wrote (orchestrator/train.py)."""
    import json

    reports = sorted((output_dir / "orch").glob("rank*.json"))
    if not reports:
        return [f"[orch] no training report in {output_dir / 'orch'}: the training did not finish"]
    ranks = [json.loads(p.read_text()) for p in reports]
    head = ranks[0]  # rank0.json, which every attempt that finishes writes anew
    world = head["world_size"]
    # an earlier attempt at a larger shape (a resume on fewer nodes) left reports of ranks this world does not have
    ranks = [r for r in ranks if r["world_size"] == world and int(r["rank"]) < world]
    lines = [
        f"[orch] ran: {ran_as(head)} over {head['backend'] or 'no process group'}, world size {world} "
        f"(ranks reporting: {spans([int(r['rank']) for r in ranks])})"
    ]
    sharding = sharding_line(ranks)
    if sharding:
        lines.append(sharding)
    adapter = head.get("adapter")
    if adapter:
        four = f"; base in 4-bit: {adapter['linear4bit']} Linear4bit layers (QLoRA)" if adapter["linear4bit"] else ""
        lines.append(
            f"[orch] trained: a LoRA adapter, {adapter['trainable_params']:,} of {adapter['params']:,} parameters"
            f"{four}"
        )
    if said := precision_line(head.get("precision")):
        lines.append(said)
    if recompute := head.get("recompute"):
        ways = ((recompute["fsdp"], "FSDP's activation checkpointing"),
                (recompute["transformers"], "transformers' gradient checkpointing"))
        by = " and ".join(f"{n} by {who}" for n, who in ways if n)
        lines.append(f"[orch] recomputed in the backward: {recompute['layers']} decoder layer(s), {by}")
    if head.get("reshaped"):
        lines.append(head["reshaped"])
    steps = head["optimizer_steps_this_run"]
    if not steps and head.get("resumed_from"):
        lines.append(
            f"[orch] resumed from {head['resumed_from']} at step {head['optimizer_steps']}, already the last step: "
            f"nothing left to train (rerun with --fresh to start over)"
        )
    if steps:
        per_step = head["total_samples"] / steps
        lines.append(
            f"[orch] {steps} optimizer steps x {per_step:g} samples "
            f"(= {head['per_device_train_batch_size']} per device x {head.get('data_parallel_ranks', world)} "
            "data-parallel ranks x "
            f"{head['gradient_accumulation_steps']} accumulation)"
        )
    rows = head.get("rows") or {}
    if rows.get("why"):  # TRL left rows of the training split out (train/kept.py)
        out = rows["given"] - rows["kept"]
        lines.append(f"[orch] data: trained on {rows['kept']:,} of the split's {rows['given']:,} rows; TRL's "
                     f"{head.get('trainer')} trainer left out {out:,}: {rows['why']}")  # fmt: skip
    if head.get("stopped"):
        lines.append(f"[orch] stopped early at step {head['optimizer_steps']}: {head['stopped']}")
    log = output_dir / "orch" / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    losses = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if losses:
        lines.append(
            f"[orch] loss: step {losses[0]['step']} {losses[0]['loss']:.4f} -> step {losses[-1]['step']} "
            f"{losses[-1]['loss']:.4f}"
        )
        if head.get("trainer") in trainers.SPECS:  # the trainer's own measures of progress (a reward, an accuracy)
            spec = trainers.spec(head["trainer"])
            last = dict(spec.headline(losses[-1]))
            for key, first in spec.headline(losses[0]):
                if key in last:
                    lines.append(f"[orch] {key}: step {losses[0]['step']} {first:.4f} -> step {losses[-1]['step']} "
                                 f"{last[key]:.4f}")  # fmt: skip
    if evals:  # eval_strategy: the evaluations' loss, first to last
        lines.append(f"[orch] eval_loss: step {evals[0]['step']} {evals[0]['eval_loss']:.4f} -> step "
                     f"{evals[-1]['step']} {evals[-1]['eval_loss']:.4f} ({len(evals)} evaluation(s))")  # fmt: skip
    lines.extend(straggler_lines(head.get("stragglers") or {}))
    if head.get("scaling"):
        lines.append(scaling.line(head["scaling"]))
    speed = throughput_line(head.get("throughput") or {})
    if speed:
        lines.append(speed)
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if checkpoints:
        lines.append(f"[orch] checkpoint: {checkpoints[-1]}{checkpoint_format(checkpoints[-1])}")
    if head.get("timeline", {}).get("first_step"):
        lines.append(f"[orch] time to first step: {time_to_first_step(head['timeline'])}")
    final = head.get("final_model")
    if final and final["loadable"]:
        files, loads = final_model.described(final)
        lines.append(f"[orch] final model: {final['path']} ({files}), Hugging Face format: {loads}")
    else:
        lines.append(f"[orch] final model: NOT written in Hugging Face format in {output_dir}")
    if head.get("pushed"):
        pushed = head["pushed"]
        lines.append(f"[orch] final model on the Hub: {pushed['url']} ({', '.join(pushed['files'])})")
    return lines
