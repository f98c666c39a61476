"""Resume at another shape (issue 32, item 1): a checkpoint saved on one world size, loaded on another.

- FSDP (SHARDED_STATE_DICT): accelerate saves model and optimizer through torch.distributed.checkpoint, whose load
  reshards to whatever ranks load it: nothing to do but say so.
- DDP: every rank holds the whole model and optimizer: nothing to reshard.
- DeepSpeed ZeRO partitions the optimizer state by data-parallel rank and refuses another world size ("Automatic
  adjustment of ZeRO's optimizer state partitioning with a new world size is not currently supported",
  deepspeed/runtime/zero). Its own answer is the universal checkpoint: `python -m deepspeed.checkpoint.ds_to_universal`
  (with --inject_missing_state: Hugging Face's saves carry no universal_checkpoint_info), then
  `checkpoint.load_universal` in the DeepSpeed config. Each node's local main process converts into node-local scratch
  (the bucket gets nothing; a node's ranks share one copy), every rank loads from there (transformers'
  `deepspeed_load_checkpoint`, given the scratch directory), and the scratch is deleted once every rank has loaded. The
  Trainer's own files (trainer state, scheduler, RNG) still come from the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.core import owned
from orchestrator.core.errors import OrchError
from orchestrator.train import run_config

RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def deepspeed_tag(ckpt: Path) -> str | None:
    """The DeepSpeed tag (global_stepN) a checkpoint's `latest` names; None for a checkpoint DeepSpeed did not write."""
    try:
        return (ckpt / "latest").read_text().strip() or None
    except OSError:
        return None


def deepspeed_saved_world(ckpt: Path) -> int | None:
    """The data-parallel world size the ZeRO optimizer states were partitioned for: their rank files."""
    tag = deepspeed_tag(ckpt)
    if tag is None or not (ckpt / tag).is_dir():
        return None
    ranks = {int(m.group(1)) for p in (ckpt / tag).iterdir() if (m := RANK_FILE.search(p.name))}
    return len(ranks) or None


def data_parallel_world(acc) -> int:
    """The ranks that split the data (and ZeRO's partitions): all of them, over sequence/context parallel groups."""
    parallelism = getattr(acc, "parallelism_config", None)
    sharing = (parallelism.sp_size or 1) * (parallelism.cp_size or 1) if parallelism is not None else 1
    return max(1, acc.num_processes // sharing)


FAMILIES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP"}  # any other distributed type: DDP or one process
PLAIN = "DDP or a single process"


def saved_by(ckpt: Path) -> str:
    """Whose checkpoint format `ckpt` is in, by its files (the tests transformers' Trainer makes before loading)."""
    if deepspeed_tag(ckpt) is not None:
        return FAMILIES["DEEPSPEED"]
    if any(p.name.startswith("pytorch_model_fsdp") for p in ckpt.iterdir()):
        return FAMILIES["FSDP"]
    return PLAIN


def other_format(acc, ckpt: Path, saved: dict, now: dict) -> str:
    """Why this run cannot load `ckpt` ("" when it can): DeepSpeed, FSDP and DDP each load only their own checkpoints
    (another accelerate config since the save, or on CPU a recipe that runs as DDP on this shape)."""
    if not ckpt.is_dir():  # a resume_from_checkpoint that is not there: the Trainer's own error names it
        return ""
    runs, was = FAMILIES.get(acc.distributed_type.value, PLAIN), saved_by(ckpt)
    if runs == was:
        return ""
    where = f" on {saved['nodes']} x {saved['per_node']}" if saved else ""
    return (f"{ckpt.name} was saved by {was}{where}, and this run is {runs} ({now['nodes']} x {now['per_node']}), "
            f"which cannot load it: resume it with {was} (the shape it was saved on runs it), or "
            f"{run_config.start_over(ckpt)}")  # fmt: skip


def method(acc, ckpt: Path, saved_world: int | None) -> str:
    """How the resume gets from the saved shape to this one ("" when the world size is the same)."""
    kind = acc.distributed_type.value
    if kind == "DEEPSPEED":
        saved = deepspeed_saved_world(ckpt)
        if saved is None or saved == data_parallel_world(acc):
            return ""
        return f"resharded: DeepSpeed's universal checkpoint, {saved} -> {data_parallel_world(acc)} ZeRO partitions"
    if saved_world in (None, acc.num_processes):
        return ""
    if kind == "FSDP":
        return "resharded: torch.distributed.checkpoint on load"
    return "replicated weights and optimizer: nothing to reshard"


def scratch_for(ckpt: Path, run: str, node: int) -> Path:
    """Room for a node's converted checkpoint (ORCH_SCRATCH_DIR, else the system's temporary directory): keyed by the
    node too, so that nodes sharing a file system there (emulated nodes, a network home) never share a conversion, and
    by the checkpoint's path, since the same task from two checkouts has one run id (their outputs differ)."""
    import hashlib

    root = Path(os.environ.get("ORCH_SCRATCH_DIR") or tempfile.gettempdir())
    where = hashlib.sha256(str(ckpt.resolve()).encode()).hexdigest()[:8]
    return root / "orch-universal" / re.sub(r"[^A-Za-z0-9_.-]", "-", run)[:100] / f"node{node}" / f"{ckpt.name}-{where}"


def convert(ckpt: Path, scratch: Path, run: str) -> Path:
    """DeepSpeed's own conversion of `ckpt` into `scratch` (made and marked as this run's): the directory to load
    from. A conversion left by an interrupted attempt of the same run is replaced."""
    tag = deepspeed_tag(ckpt)
    assert tag is not None
    source = ckpt / tag
    need = sum(p.stat().st_size for p in source.iterdir() if p.is_file())
    owned.remove(scratch, run, "ORCH_SCRATCH_DIR")
    if not owned.claim(scratch, run):
        raise OrchError(f"ORCH_SCRATCH_DIR: {scratch} appeared meanwhile and is not orch's; choose another directory")
    free = shutil.disk_usage(scratch).free
    if free < need * 1.1:
        raise OrchError(f"resharding {ckpt.name} for DeepSpeed needs ~{need / 2**30:.1f} GiB of scratch space, "
                        f"{scratch.parent} has {free / 2**30:.1f} GiB free: point ORCH_SCRATCH_DIR at a larger "
                        "local disk, or resume on the shape it was saved on")  # fmt: skip
    print(f"[orch] converting {ckpt.name} ({need / 2**30:.1f} GiB of ZeRO states) into DeepSpeed's universal "
          f"checkpoint in {scratch}...", flush=True)  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state", "--input_folder",
         str(source), "--output_folder", str(scratch / f"{tag}_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        lines = [x for x in (done.stderr or done.stdout).strip().splitlines() if x.strip()]
        raise OrchError(f"DeepSpeed's universal checkpoint conversion of {ckpt.name} failed: "
                        f"{lines[-1] if lines else f'exit {done.returncode}'}")  # fmt: skip
    print(f"[orch] converted {ckpt.name} in {time.monotonic() - began:.1f} s", flush=True)
    return scratch


def untie_steps(optimizer) -> int:
    """Give each parameter's optimizer state its own `step` tensor; the number untied.

    ZeRO-3's universal load (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3) assigns one `step` tensor
    to the state of every sub-group, and torch's Adam increments it in place, once per sub-group per step: measured on
    a 2-group model (weights with decay, norms without), checkpoint-5 of the resumed run saved step 6 and the second
    group's weights were off by ~9e-5 after one step, its losses by 5e-3 three steps later."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    seen: set[int] = set()
    untied = 0
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
                untied += 1
            seen.add(id(state["step"]))
    return untied


def install(trainer, ckpt: Path, run: str, node: int, is_local_main: bool, barrier) -> None:
    """Make this process's DeepSpeed engine load `ckpt` through DeepSpeed's universal checkpoint: the node's local
    main converts it, every rank loads the conversion, the local main deletes it afterwards."""
    import transformers.trainer

    scratch = scratch_for(ckpt, run, node)
    error = ""
    if is_local_main:
        try:
            convert(ckpt, scratch, run)
        except OrchError as exc:
            error = str(exc)
    failed = barrier(1 if error else 0)  # every rank learns whether any node's conversion failed
    if error:
        raise OrchError(error)
    if failed:
        raise OrchError(f"DeepSpeed's universal checkpoint conversion of {ckpt.name} failed on another node")
    plugin = trainer.accelerator.state.deepspeed_plugin
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    original = transformers.trainer.deepspeed_load_checkpoint

    def load_converted(engine, checkpoint_path, *args, **kwargs):
        if Path(checkpoint_path).resolve() != ckpt.resolve():
            return original(engine, checkpoint_path, *args, **kwargs)
        try:
            loaded = engine.load_checkpoint(str(scratch), load_module_strict=kwargs.get("load_module_strict", True),
                                            load_optimizer_states=True, load_lr_scheduler_states=True)  # fmt: skip
            untie_steps(engine.optimizer)
            return loaded
        finally:
            barrier(0)  # every rank has read the conversion
            if is_local_main:
                owned.remove(scratch, run, "ORCH_SCRATCH_DIR")
                for parent in (scratch.parent, scratch.parent.parent):  # the node's and the run's, once empty
                    with contextlib.suppress(OSError):
                        parent.rmdir()
            transformers.trainer.deepspeed_load_checkpoint = original

    transformers.trainer.deepspeed_load_checkpoint = load_converted
