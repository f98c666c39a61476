"""Smoke artifacts, for local smoke runs and rehearsals: where the tiny model and data live, and the TRL
overrides that point a recipe at them.

A tiny random model of the recipe's architecture, a tokenizer trained here and synthetic data in the trainer's
format are built on this machine in seconds, with no network, by `orchestrator.train.smoke_build` in a
subprocess (so `orch` itself never imports torch), and cached by content under $ORCH_CACHE_DIR (default
~/.cache/orch): the cache key hashes both modules, the model family and the trainer, so editing the builder
rebuilds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core import home, trainers
from orchestrator.core.errors import OrchError
from orchestrator.core.models import Family, family_of

BUILDER = "orchestrator.train.smoke_build"
STEPS = 8
# The smoke settings a run's own TRL_OVERRIDES may change on a node (`orch run --gpus none --smoke max_steps=400`, or
# plain `sky launch --env ORCH_SMOKE=on --env TRL_OVERRIDES=...`): its length and schedule. The rest points TRL at the
# tiny artifacts and keeps it CPU-friendly, and wins over the recipe's own TRL_OVERRIDES.
SCHEDULE = ("max_steps", "save_steps", "save_total_limit", "save_strategy", "logging_steps", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "seed")  # fmt: skip


@dataclass(frozen=True)
class SmokePlan:
    model_type: str
    trainer: str
    dir: Path
    """Cache directory holding model/ (weights + tokenizer) and data/ (train.jsonl)."""

    @property
    def ready(self) -> bool:
        return (self.dir / "READY").is_file()


def cache_root(env: dict | os._Environ = os.environ) -> Path:
    return home.cache_dir(env) / "smoke"


def plan(model_id: str, trainer: str, root: Path | None = None, family: Family | None = None) -> SmokePlan:
    """Pure apart from reading this file: where the artifacts for (model family, trainer) live. `family`: the model's
    as its config.json says (node/model_config.family), else by its name."""
    family = family or family_of(model_id)
    builder = Path(__file__).resolve().parent.parent / "train" / "smoke_build.py"
    sources = Path(__file__).read_bytes() + builder.read_bytes() + Path(trainers.__file__).read_bytes()
    digest = hashlib.sha256(sources + f"{family.model_type}/{trainer}".encode()).hexdigest()
    root = cache_root() if root is None else root
    return SmokePlan(family.model_type, trainer, root / f"{family.model_type}-{trainer}-{digest[:12]}")


SMOKE_REWARD = "orchestrator.train.smoke_build.digit_reward"


def trl_overrides(smoke: SmokePlan, settings: Mapping[str, object] | None = None) -> dict[str, str]:
    """TRL arguments that point a recipe at the tiny artifacts and make it short, fp32 and CPU-friendly. A generating
    trainer (GRPO, RLOO) keeps the recipe's own reward functions (`settings`: its TRL settings) and gets the smoke
    reward beside them: a tiny random model's completions score 0 on a real reward, which would leave nothing to
    learn from, while the recipe's functions still run on every completion."""
    out = {
        "model_name_or_path": str(smoke.dir / "model"),
        "dataset_name": str(smoke.dir / "data"),
        "dataset_train_split": "train",
        "dataset_test_split": "train",  # the only split: with an eval_strategy, evaluation runs on it
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "use_liger_kernel": "false",
        "max_steps": str(STEPS),
        "per_device_train_batch_size": "1",
        "learning_rate": "2e-3",
        "lr_scheduler_type": "constant",
        "warmup_steps": "0",
        "logging_steps": "1",
        "save_strategy": "steps",
        "save_steps": "4",
        "save_total_limit": "2",
        "bf16": "false",
        "report_to": "none",
        "disable_tqdm": "true",
        "dataloader_num_workers": "0",
        "ddp_find_unused_parameters": "false",
        "seed": "42",
    }
    spec = trainers.spec(smoke.trainer)
    out.update(spec.smoke_overrides)  # the trainer's own (core/trainers.py)
    if spec.generates:
        given = (settings or {}).get("reward_funcs") or []
        names = given.split() if isinstance(given, str) else [str(n) for n in given] if isinstance(given, list) else []
        out["reward_funcs"] = " ".join([*(n for n in names if n != SMOKE_REWARD), SMOKE_REWARD])
    return out


@contextlib.contextmanager
def builder_lock(directory: Path, waiting: str = "") -> Iterator[None]:
    """One builder at a time for a cache directory: an flock on `.<name>.lock` beside it. Every node of a Slurm
    account shares its home, and with it this cache: without it each node built the same model into the same place
    at once (one more import of the training stack beside the head node's rehearsal). Where the filesystem has no
    locks (some Lustre and NFS mounts), none: the build's atomic rename keeps the directory whole, only the work is
    repeated. `waiting`, when the lock is held elsewhere, is printed before waiting for it."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory.parent / f".{directory.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a cache it cannot write: the build says so in its own words
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                if waiting:
                    print(waiting, flush=True)
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure(smoke: SmokePlan) -> None:
    """Build the artifacts in a subprocess unless cached (or built meanwhile by another process sharing the cache).
    Prints one progress line either way."""
    if not smoke.ready:  # another node of a shared home may be building it: wait for it rather than build it again
        with builder_lock(smoke.dir, f"[orch] smoke: waiting for another process building {smoke.dir}"):
            pass
    if smoke.ready:
        print(f"[orch] smoke: tiny {smoke.model_type} model and {smoke.trainer} data cached at {smoke.dir}", flush=True)
        return
    print(
        f"[orch] smoke: building tiny {smoke.model_type} model, tokenizer and {smoke.trainer} data (no network)...",
        flush=True,
    )
    cmd = [sys.executable, "-m", BUILDER, smoke.model_type, smoke.trainer, str(smoke.dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        missing = tail[0].startswith(("ModuleNotFoundError", "ImportError"))  # only then is the stack to blame
        raise OrchError(f"building the smoke model failed: {tail[0]}" +
                        ("; is the training stack installed? (make install)" if missing else ""))
    print(f"[orch] smoke: built at {smoke.dir}", flush=True)
