"""`orch pull RUN [DIR]`: bring a run's final model to this machine from wherever it was written."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from pathlib import Path

from orchestrator.commands import add
from orchestrator.core.errors import OrchError
from orchestrator.core.final_model import size_words

EPILOG = """\
examples:
  orch pull my-run                 # into ./models/<run>/
  orch pull my-run ~/models/dpo    # into a directory of yours

Where from, in order: the Hugging Face repo the run pushed to (--push-to-hub), the output directory of a local
run, the head node of a cluster run (rsync over SkyPilot's SSH alias; the cluster must be up). Only the final
model's files come (weights or LoRA adapter, config, tokenizer), not checkpoints.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "pull",
        help="bring a run's final model here (from the Hub, a local run or the cluster)",
        description="Copy a run's final model (weights or adapter, config, tokenizer) to a directory here.",
        epilog=EPILOG,
    )
    parser.add_argument("run", help="run name (or a unique prefix), as `orch status` lists it")
    parser.add_argument("dir", nargs="?", type=Path, help="where to put it (default: ./models/<run>)")
    parser.set_defaults(func=main)


def _from_directory(source: Path, dest: Path) -> None:
    from orchestrator.core.final_model import is_final_file

    files = [p for p in source.iterdir() if p.is_file() and is_final_file(p.name)] if source.is_dir() else []
    if not files:
        raise OrchError(f"no final model in {source}: the run has not finished (or wrote it elsewhere)")
    dest.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, dest / path.name)


def _shown(path: Path) -> str:
    """A path as short as it is clear: relative to the current directory when it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(args: argparse.Namespace) -> int:
    from orchestrator.core import owned
    from orchestrator.launch import backends, records

    record = records.find(args.run)
    dest = args.dir or Path("models") / record.run
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise OrchError(f"{dest} is not an empty directory: give an empty or new one")
    parents = [p for p in dest.absolute().parents if not os.path.lexists(p)]  # made with it, removed with it
    made = not os.path.lexists(dest) and owned.claim(dest, record.run)  # a failed pull removes only what it made
    repo = (record.task.get("envs") or {}).get("ORCH_PUSH_TO_HUB")
    try:
        if repo:
            where = f"the Hub ({repo})"
            from orchestrator.launch.model_out import download

            download(repo, dest)
        else:
            instead = "its final model is in the checkpoint bucket the recipe mounts; or rerun with --push-to-hub"
            source = backends.for_record(record).output(record, "final", dest, otherwise=instead)
            where = _shown(source) if source != dest else f"cluster {record.get('cluster')}"
            if source != dest:
                _from_directory(source, dest)
    except BaseException:
        if made:  # nothing half written
            owned.remove(dest, record.run, "orch pull")
            for parent in parents:  # nearest first; only while empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
        raise
    owned.unmark(dest)  # the model is the user's now: orch never deletes it
    files = sorted(p.name for p in dest.iterdir() if p.is_file())
    size = sum((dest / f).stat().st_size for f in files)
    print(f"[orch] {record.run}: final model from {where} -> {dest} ({len(files)} files, {size_words(size)})")
    adapter = "adapter_config.json" in files
    loader = "peft's AutoPeftModelForCausalLM" if adapter else "transformers' AutoModelForCausalLM"
    print(f"[orch] load it with {loader}.from_pretrained({str(dest)!r})")
    return 0
