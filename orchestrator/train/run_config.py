"""What a checkpoint was trained with, and what a resume changes (issue 30, item 7).

Every checkpoint keeps `orch_config.json`: the resolved training configuration as TRL's parser gave it to this run
(script, training and model arguments) and the shape it ran on. A rerun that resumes from it compares: a changed
training setting (a TRL config edited between runs, say) stops every rank before the first step with one line
naming each change, unless ORCH_RESUME_CHANGED=on; a changed shape (nodes x processes, world size: `shape_line`,
resharded by train/reshape.py) and a longer or shorter schedule (max_steps, num_train_epochs) are reported and never
need it. The check runs on the node, so plain
`sky launch` users get it too.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields, is_dataclass
from pathlib import Path

from orchestrator.core.errors import OrchError

CONFIG = "orch_config.json"
# Not training settings: where output goes, how often it is logged or saved, tracking, and what orch derives from the
# shape (the per-device batch and accumulation keep GLOBAL_BATCH_SIZE, which is compared instead; GRPO/RLOO's
# steps_per_generation is the accumulation by TRL's default, or generation_batch_size over the ranks' micro-batches:
# generation_batch_size, which TRL's config always sets, is compared instead).
VOLATILE = {
    "output_dir", "logging_dir", "run_name", "resume_from_checkpoint", "overwrite_output_dir", "local_rank",
    "hub_token", "hub_model_id", "push_to_hub", "hub_strategy", "hub_private_repo", "report_to", "logging_steps",
    "logging_strategy", "logging_first_step", "save_steps", "save_strategy", "save_total_limit", "save_on_each_node",
    "eval_steps", "eval_strategy", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "dataloader_num_workers", "ddp_timeout", "disable_tqdm", "trackio_space_id",
    "project", "deepspeed", "fsdp", "fsdp_config", "accelerator_config", "log_level", "log_level_replica",
    "steps_per_generation",
}  # fmt: skip
SCHEDULE = ("max_steps", "num_train_epochs")
"""Said when they change (a run trained longer), never refused."""


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def of(parsed, world: int, nodes: int) -> dict:
    """This run's resolved configuration: every argument TRL's parser set (private and volatile ones left out)."""
    settings: dict[str, object] = {}
    for part in (parsed.script_args, parsed.training_args, parsed.model_args):
        if part is None or not is_dataclass(part):
            continue
        for field in fields(part):
            if not field.name.startswith("_") and field.name not in VOLATILE:
                settings[field.name] = _plain(getattr(part, field.name, None))
    settings["GLOBAL_BATCH_SIZE"] = os.environ.get("GLOBAL_BATCH_SIZE", "")
    return {"trainer": parsed.trainer, "settings": settings,
            "shape": {"nodes": nodes, "per_node": max(1, world // max(1, nodes)), "world": world}}  # fmt: skip


def write(ckpt: Path, config: dict) -> None:
    tmp = ckpt / f".{CONFIG}.{os.getpid()}.tmp"  # nodes on one shared file system write it at once
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True))
    os.replace(tmp, ckpt / CONFIG)


def saved_shape(ckpt: Path) -> dict:
    """The shape a checkpoint was saved on ({"nodes", "per_node", "world"}; {} when it keeps no orch_config.json)."""
    try:
        return json.loads((ckpt / CONFIG).read_text()).get("shape") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def shape_line(ckpt: Path, was: dict, now: dict, how: str) -> str:
    """What a resume on another shape says ("" on the same shape): where it was saved, where it runs, how."""
    if not was or was == now:
        return ""
    how = how or f"world size {was.get('world')} -> {now['world']}: the same partitions"
    step = ckpt.name.rpartition("-")[2]
    return (f"[orch] resumed at step {step} from {ckpt.name}, saved on {was.get('nodes')} x {was.get('per_node')}, "
            f"now {now['nodes']} x {now['per_node']} ({how})")


def compare(ckpt: Path, now: dict, anyway: bool) -> list[str]:
    """The lines to print on resuming from `ckpt`; an OrchError naming every changed setting unless `anyway`."""
    try:
        saved = json.loads((ckpt / CONFIG).read_text())
    except (OSError, ValueError):
        return [f"[orch] note: {ckpt.name} keeps no {CONFIG} (saved by an earlier orch): its settings are not compared"]
    lines = []
    before, after = saved.get("settings") or {}, now["settings"]
    changed = [key for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    for key in [k for k in changed if k in SCHEDULE]:
        lines.append(f"[orch] note: {key} {before.get(key)!r} -> {after.get(key)!r} since {ckpt.name}")
    changed = [k for k in changed if k not in SCHEDULE]
    if saved.get("trainer") != now["trainer"]:
        changed.insert(0, "trainer")
        before, after = {**before, "trainer": saved.get("trainer")}, {**after, "trainer": now["trainer"]}
    if changed:
        words = ", ".join(f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:8])
        more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
        if not anyway:
            raise OrchError(
                f"{ckpt.name} was trained with other settings: {words}{more}; to resume anyway set "
                f"ORCH_RESUME_CHANGED=on (orch run --env ORCH_RESUME_CHANGED=on), or {start_over(ckpt)}"
            )
        lines.append(f"[orch] resuming {ckpt.name} with changed settings (ORCH_RESUME_CHANGED=on): {words}{more}")
    return lines


def start_over(ckpt: Path) -> str:
    """The way out when a checkpoint cannot be resumed from: its output dir, which `orch run --fresh` deletes only when
    orch made it for this same run (core/owned.py; an output_dir shared by runs of other settings is another's)."""
    return (f"start a new run in another output_dir, or empty this one ({ckpt.parent}: `orch run --fresh` deletes it "
            "when orch made it for this same run, rm -r otherwise)")
