"""Checkpoints and the final model, as the training process writes and finds them.

A checkpoint counts as complete only when its manifests say so: after every rank saved, each node writes
`orch_manifest.node<N>.json` last, listing every file it sees with its size, and the SHA-256 of the files assigned
to that node (by a hash of the name, so the nodes share the hashing). A marker file alone is not enough: a bucket
mount uploads in the background, and a marker can arrive before the shards. At start every rank agrees on the
newest checkpoint that verifies everywhere (`choose_resume`); a newer one that does not verify is skipped and
recorded in <output_dir>/orch_quarantine.jsonl, never renamed (on a bucket a rename copies the whole checkpoint).
The final model is written in Hugging Face format at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

MANIFEST = "orch_manifest.node{}.json"
QUARANTINE = "orch_quarantine.jsonl"
DIVERGED = "orch_diverged.json"
"""In a checkpoint saved after the last finite logging step of a run that diverged (train/divergence.py): its weights
may not be finite, and no resume starts from it."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin")


def _owner(name: str, nodes: int) -> int:
    """The node that hashes a file: stable whatever order or subset of the files a node sees."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % max(1, nodes)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _files(ckpt: Path) -> dict[str, int]:
    """The checkpoint's files and sizes, manifests left out: the nodes write theirs at the same time (each through a
    `.orch_manifest.nodeN.json.tmp` that another node may see, or see vanish, while it lists the directory)."""
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.name.startswith(("orch_manifest.", ".orch_manifest.", "orch_config.json", ".orch_config.json")):
            continue
        try:
            if p.is_file():
                files[p.relative_to(ckpt).as_posix()] = p.stat().st_size
        except FileNotFoundError:
            continue
    return files


def write_manifest(ckpt: Path, node: int, nodes: int, step: int) -> Path:
    """This node's manifest of a saved checkpoint, written last and atomically (temp file + rename)."""
    files = _files(ckpt)
    hashes = {name: _sha256(ckpt / name) for name in files if _owner(name, nodes) == node}
    path = ckpt / MANIFEST.format(node)
    tmp = ckpt / f".{path.name}.tmp"
    tmp.write_text(json.dumps({"step": step, "node": node, "nodes": nodes, "time": time.time(), "sizes": files,
                               "sha256": hashes}, indent=0))  # fmt: skip
    os.replace(tmp, path)
    return path


def verify(ckpt: Path, node: int | None = None) -> str:
    """ "" when the checkpoint is complete, else why not. Every caller checks that all nodes' manifests are there and
    every listed file has its size; `node` also re-hashes the files that node hashed when it saved."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # no marker (or not one of orch's)
        verdict = json.loads((ckpt / DIVERGED).read_text())["verdict"]
        return f"saved after {verdict.split('. ')[0]}"
    manifests = sorted(ckpt.glob("orch_manifest.node*.json"))
    if not manifests:
        return "no manifest (the save did not finish)"
    try:
        loaded = [json.loads(p.read_text()) for p in manifests]
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    nodes = loaded[0]["nodes"]
    missing = sorted(set(range(nodes)) - {m["node"] for m in loaded})
    if missing:
        return f"node(s) {', '.join(map(str, missing))} wrote no manifest"
    for manifest in loaded:
        for name, size in manifest["sizes"].items():
            path = ckpt / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if manifest["node"] == node:
            for name, digest in manifest["sha256"].items():
                if _sha256(ckpt / name) != digest:
                    return f"{name} does not match its SHA-256 in the manifest"
    return ""


def steps(output_dir: Path) -> list[int]:
    """Steps of the checkpoint-N directories, newest first."""
    if not output_dir.is_dir():
        return []
    names = [p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")]
    return sorted((int(n[11:]) for n in names if n[11:].isdigit()), reverse=True)


def choose_resume(
    output_dir: Path, node: int | None, min_over_ranks: Callable[[int], int]
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint every rank resumes from, the newest that verifies on every node, and the newer ones skipped
    as (path, reason). min_over_ranks(x) is the smallest x over all ranks (a collective in a real run): every rank
    runs the same rounds, so they agree even where their disks or their share of the hashing differ."""
    reasons: dict[int, str] = {}

    def why(step: int) -> str:
        if step not in reasons:
            reasons[step] = verify(output_dir / f"checkpoint-{step}", node)
        return reasons[step]

    excluded: set[int] = set()
    while True:
        local = next((s for s in steps(output_dir) if s not in excluded and not why(s)), -1)
        chosen = min_over_ranks(local)
        if chosen < 0 or min_over_ranks(0 if why(chosen) else 1):
            break
        excluded.add(chosen)
    newer = sorted(s for s in steps(output_dir) if s > chosen)
    skipped = [(output_dir / f"checkpoint-{s}", why(s) or "not complete on every node") for s in newer]
    return (output_dir / f"checkpoint-{chosen}" if chosen >= 0 else None), skipped


def mark_diverged(output_dir: Path, after_step: int, verdict: str) -> list[str]:
    """Mark the checkpoints saved after `after_step` (the last logging step whose gradients and loss were finite) as
    saved after the divergence `verdict` says; their names."""
    marked = []
    for step in sorted(s for s in steps(output_dir) if s > after_step):
        ckpt = output_dir / f"checkpoint-{step}"
        tmp = ckpt / f".{DIVERGED}.{os.getpid()}"
        tmp.write_text(json.dumps({"after_step": after_step, "verdict": verdict}))
        os.replace(tmp, ckpt / DIVERGED)
        marked.append(ckpt.name)
    return marked


def quarantine(output_dir: Path, skipped: list[tuple[Path, str]]) -> Path:
    """Append the skipped checkpoints to the run's quarantine list (one JSON line each)."""
    path = output_dir / QUARANTINE
    with open(path, "a") as fh:
        for ckpt, reason in skipped:
            fh.write(json.dumps({"checkpoint": ckpt.name, "reason": reason, "time": time.time()}) + "\n")
    return path


def tensor_dtypes(files: list[Path]) -> list[str]:
    """The dtypes of the tensors in safetensors files, most bytes first (read from their headers)."""
    sizes: dict[str, int] = {}
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with open(path, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                sizes[info["dtype"]] = sizes.get(info["dtype"], 0) + end - start
    return sorted(sizes, key=lambda d: -sizes[d])


def final_model_files(output_dir: Path) -> dict:
    """What a finished run left for `from_pretrained`: a config and weights in Hugging Face format, their size and
    their tensors' dtypes."""
    weights = sorted(p.name for p in output_dir.glob("*") if p.name in WEIGHT_FILES or p.name.startswith("model-"))
    has_config = (output_dir / "config.json").is_file() or (output_dir / "adapter_config.json").is_file()
    return {
        "path": str(output_dir),
        "weights": weights,
        "bytes": sum((output_dir / w).stat().st_size for w in weights),
        "dtypes": tensor_dtypes([output_dir / w for w in weights]),
        "loadable": has_config and bool(weights),
    }


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def as_dtype(value):
    """A torch dtype from a config's `dtype` (a torch.dtype, or its name as config.json and save_pretrained write
    it); None for anything else."""
    import torch

    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def load_dtype(model):
    """The dtype the model was loaded and computes in, read when it is built. Not at the end: transformers'
    save_pretrained (every FULL_STATE_DICT checkpoint saves through it) sets `config.dtype` to the name of the
    parameters' dtype, which accelerate has upcast to fp32 by then (measured: TRL's fsdp2 profile ended every run
    with `Invalid device string: 'float32'`, and a bf16 model would have been written in fp32)."""
    return as_dtype(getattr(getattr(model, "config", None), "dtype", None))


def in_dtype(state_dict: dict, dtype) -> dict:
    """fp32 floating tensors cast to `dtype` (the dtype the model was loaded and computes in); others as they are."""
    import torch

    dtype = as_dtype(dtype)
    if dtype is None or dtype == torch.float32:
        return state_dict
    return {k: v.to(dtype) if torch.is_tensor(v) and v.dtype == torch.float32 else v for k, v in state_dict.items()}


WRAPPED = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper: accelerate's FSDP activation checkpointing


def save_adapter(trainer, output_dir: str, trainable: dict) -> None:
    """PEFT's adapter files from the gathered trainable parameters, the main process only.

    PEFT picks a state dict's adapter entries by the names of its tuner modules (`_get_tuner_state_dict_key_prefixes`,
    PEFT 0.21), which under FSDP's activation checkpointing hold torch's `_checkpoint_wrapped_module.` while state
    dicts drop it: its own `save_pretrained` then writes an adapter with no tensors (measured: a 40-byte file). The
    entries are handed to PEFT under the module names it expects, PEFT selects and names them, and the wrapper's
    name is taken out of what it returns, as a model without the wrapper would have saved it."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, get_peft_model_state_dict
    from safetensors.torch import save_file

    model = trainer.model
    named = {name.replace(WRAPPED, ""): name for name, _ in model.named_parameters()}
    adapter = get_peft_model_state_dict(model, state_dict={named.get(k, k): v for k, v in trainable.items()})
    weights = {k.replace(WRAPPED, ""): v.contiguous() for k, v in adapter.items()}
    trained = sum(p.requires_grad for p in model.parameters())  # the state dict also holds 4-bit quant states
    if len(weights) != trained:
        raise RuntimeError(f"PEFT selected {len(weights)} of the {trained} trained parameters for the adapter")
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(output_dir) / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    model.peft_config[model.active_adapter].save_pretrained(output_dir)
    model.create_or_update_model_card(output_dir)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)


def save_final_model(trainer, output_dir: str) -> dict | None:
    """Write the final model in Hugging Face format; the main process returns what it wrote (None elsewhere).

    Under FSDP transformers' `save_model` writes only a full state dict, which accelerate gathers to rank 0 on CPU;
    recipes keep sharded checkpoints, so the last save gathers one itself (every rank must call this: gathering is a
    collective), and writes it in the dtype the model was loaded in: accelerate upcasts trained parameters to fp32
    under mixed precision (fp32 master weights), which would write a bf16 recipe's model at twice its size. A PEFT
    model gathers its trainable parameters only (torch's `ignore_frozen_params`): the adapter is what gets written,
    and the frozen base, 4-bit weights included, is never gathered (bitsandbytes#1945: `full_tensor()` of FSDP2's
    4-bit shards can crash).
    """
    if not getattr(trainer, "is_fsdp_enabled", False):
        trainer.save_model(output_dir)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = trainer.model
        peft = is_peft(model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=peft)
        state_dict = get_model_state_dict(model, options=options)
        if trainer.args.should_save and peft:
            save_adapter(trainer, output_dir, state_dict)
        elif trainer.args.should_save:
            trainer._save(output_dir, state_dict=in_dtype(state_dict, trainer.orch_load_dtype))
    if not trainer.args.should_save:
        return None
    return final_model_files(Path(output_dir))
