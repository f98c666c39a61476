"""Download a recipe's model(s), dataset(s) and attention kernel once per node, in parallel, before any GPU process
starts.

`python -m orchestrator.train.prefetch` (run by scripts/node-setup.sh with the task's envs and secrets) reads the
recipe's TRL config and TRL_OVERRIDES, then fetches every Hub repo the training will load (the model, a GRPO
reward model, the dataset or dataset mixture, a Kernels Hub attention kernel, which it also loads as the ranks will:
train/attention_kernel.py) into the Hugging Face cache the training processes read, with huggingface_hub's own
downloader (hf_xet where the Hub serves Xet; HF_XET_HIGH_PERFORMANCE is set by the setup). Local paths are left alone.
A gated or missing repo ends the setup with one line naming the fix, before the cluster has trained nothing for
minutes."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import attention as attention_names
from orchestrator.core import configs, overrides
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.train import attention_kernel
from orchestrator.train.hub_link import CLOSED_CLIENT, is_link

# Weights in other formats and the original (non-transformers) checkpoints that Meta's repos carry: never loaded.
MODEL_IGNORE = ["original/*", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "*.tflite"]


class Repo(NamedTuple):
    repo_id: str
    repo_type: str
    """model, dataset or kernel (train/attention_kernel.py)."""
    revision: str | None = None
    why: str = ""
    config: str | None = None
    """A dataset's config name (TRL's dataset_config); a kernel's name as transformers loads it."""


def repos(settings: Mapping) -> list[Repo]:
    """The Hub repos a trainer with these TRL settings loads (local paths excluded). A streamed dataset
    (dataset_streaming; a mixture's `streaming`) is read by the ranks as they train: not downloaded here."""
    found = []
    if settings.get("model_name_or_path"):
        found.append(Repo(str(settings["model_name_or_path"]), "model", settings.get("model_revision"), "model"))
    if settings.get("reward_model_name_or_path"):  # GRPO
        found.append(Repo(str(settings["reward_model_name_or_path"]), "model", None, "reward model"))
    found += [] if streamed(settings) else _datasets(settings)
    return [r for r in found if not Path(r.repo_id).exists()]


def _datasets(settings: Mapping) -> list[Repo]:
    """The datasets the training entry loads: TRL's `datasets:` mixture, else dataset_name (which TRL then ignores)."""
    mixture = [e for e in settings.get("datasets") or [] if isinstance(e, Mapping) and e.get("path")]
    if mixture:
        return [Repo(str(e["path"]), "dataset", e.get("revision"), "dataset", e.get("name")) for e in mixture]
    if settings.get("dataset_name"):
        return [Repo(str(settings["dataset_name"]), "dataset", None, "dataset", settings.get("dataset_config"))]
    return []


def _streaming_key(settings: Mapping) -> str:
    """The TRL setting that streams what the entry loads: a mixture's own `streaming`, else dataset_streaming."""
    return "streaming" if settings.get("datasets") else "dataset_streaming"


def streamed(settings: Mapping) -> list[str]:
    """The datasets the ranks stream as they train (all the entry loads, or none)."""
    return [r.repo_id for r in _datasets(settings)] if overrides.truthy(settings.get(_streaming_key(settings))) else []


PROGRESS_EVERY = 30.0  # seconds between progress lines (ORCH_PREFETCH_PROGRESS_S)


def _progress(wanted: list[Repo], started: float, every: float, done: threading.Event, out) -> None:
    """A line every `every` seconds while the download runs: bytes in the Hub cache for these repos so far."""
    from huggingface_hub import constants

    blobs = [Path(constants.HF_HUB_CACHE) / f"{r.repo_type}s--{r.repo_id.replace('/', '--')}" / "blobs" for r in wanted]
    while not done.wait(every):
        size = 0
        for folder in blobs:  # the files themselves (snapshots/ holds links to them), *.incomplete ones too
            with contextlib.suppress(OSError):  # renamed or removed under the walk: counted at the next line
                size += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"[orch] prefetch: {size / 1e9:.2f} GB downloaded so far ({time.monotonic() - started:.0f} s)",
              file=out, flush=True)  # fmt: skip


ATTEMPTS = 3  # tries of one repo when the link stalls or drops (the Hub's client does not retry a file's GET)


def fetch(repo: Repo, token: str | None, out=sys.stdout) -> tuple[str, int]:
    """(local snapshot dir, bytes) of one repo, or an OrchError naming the fix. A timeout or a dropped connection is
    tried again (snapshot_download resumes the files it left incomplete), then refused in one line."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo, token)
    return tried(repo, token, lambda: _fetch_once(repo, token), out)


def tried(repo: Repo, token: str | None, once, out=sys.stdout) -> tuple[str, int]:
    """once() up to ATTEMPTS times while the link to the Hub fails it (hub_link.is_link), saying each try again; then
    one line naming the network. Any other error is once()'s own."""
    import httpx
    from huggingface_hub import constants

    label = f"{repo.why} {repo.repo_id}"
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return once()
        except Exception as exc:
            if not is_link(exc):  # the Hub's answer (or a bug): once()'s own error
                raise
            if CLOSED_CLIENT in str(exc):
                exc = _connection_error(repo, token) or exc
            if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
                why = f"no answer within {constants.HF_HUB_DOWNLOAD_TIMEOUT} s ({type(exc).__name__})"
            else:
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            if attempt == ATTEMPTS:
                raise OrchError(
                    f"{label} could not be downloaded from {constants.ENDPOINT}: {why}, {ATTEMPTS} tries; check the "
                    "node's network (or HF_ENDPOINT), or raise HF_HUB_DOWNLOAD_TIMEOUT for a slow link; nodes with no "
                    "route to the Hub: fill HF_HOME's cache where there is one and set HF_HUB_OFFLINE=1"
                ) from None
            print(f"[orch] prefetch: {label}: {why}; trying again ({attempt + 1}/{ATTEMPTS})", file=out, flush=True)
            time.sleep(attempt)
    raise AssertionError("unreachable")


def _connection_error(repo: Repo, token: str | None) -> Exception | None:
    """The error a fresh metadata request for `repo` meets (one request, no retry, 10 s), when it is the connection's:
    what the closed-client RuntimeError hid."""
    import httpx
    from huggingface_hub import HfApi

    try:
        HfApi().repo_info(repo.repo_id, repo_type=repo.repo_type, revision=repo.revision, token=token, timeout=10)
    except (httpx.TransportError, ConnectionError, TimeoutError) as exc:
        return exc
    except Exception:  # noqa: BLE001 - the Hub answered this time: the retry will say what it says
        return None
    return None


def _from_cache(repo: Repo, token: str | None) -> tuple[str, int]:
    """HF_HUB_OFFLINE=1 (nodes with no route to the Hub, as on many Slurm clusters, their cache filled beforehand): the
    repo read from the cache as the training processes will read it, or one line saying how to fill it. Nothing is
    tried again: the Hub is not asked."""
    from huggingface_hub import snapshot_download

    try:
        if repo.repo_type == "dataset":
            return _load_dataset(repo, token)
        path = snapshot_download(repo.repo_id, revision=repo.revision, token=token)
    except (FileNotFoundError, ConnectionError):  # huggingface_hub's LocalEntryNotFoundError; datasets' offline miss
        raise _not_cached(f"{repo.why} {repo.repo_id}") from None
    return path, sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _not_cached(label: str) -> OrchError:
    from huggingface_hub import constants

    return OrchError(
        f"{label} is not in this node's Hugging Face cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 keeps the "
        "node off the Hub: fill that cache where the Hub can be reached (this setup there, with the same HF_HOME), or "
        "unset HF_HUB_OFFLINE"
    )


def _fetch_once(repo: Repo, token: str | None) -> tuple[str, int]:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    label = f"{repo.why} {repo.repo_id}"
    try:
        if repo.repo_type == "dataset":
            return _load_dataset(repo, token)
        files = HfApi().list_repo_files(repo.repo_id, revision=repo.revision, token=token)
        ignore = MODEL_IGNORE + (["*.bin"] if any(f.endswith(".safetensors") for f in files) else [])
        path = snapshot_download(repo.repo_id, revision=repo.revision, token=token, ignore_patterns=ignore)
    except GatedRepoError:
        fix = "accept its terms on its Hub page, and give a token of that account"
        if not token:
            fix = "give HF_TOKEN as a secret (`--secret HF_TOKEN` to orch run or sky launch) and accept its terms"
        raise OrchError(f"{label} is gated on the Hugging Face Hub and this node may not read it: {fix}") from None
    except RepositoryNotFoundError:
        raise OrchError(
            f"{label} does not exist on the Hugging Face Hub (or is private: give HF_TOKEN); check the TRL config"
        ) from None
    except RevisionNotFoundError:
        raise OrchError(f"{label} has no revision {repo.revision!r}; check the TRL config") from None
    except HfHubHTTPError as exc:
        raise OrchError(f"{label} could not be downloaded: {' '.join(str(exc).split())[:300]}") from None
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return path, size


def _load_dataset(repo: Repo, token: str | None) -> tuple[str, int]:
    """As the trainer will (datasets.load_dataset): downloads and prepares the Arrow files it then reuses
    (raw files in the Hub cache alone are not enough for `datasets`)."""
    from datasets import load_dataset

    loaded = load_dataset(repo.repo_id, name=repo.config, revision=repo.revision, token=token)
    files = {f["filename"] for split in loaded.values() for f in split.cache_files}
    return (os.path.dirname(next(iter(files))) if files else ""), sum(os.path.getsize(f) for f in files)


def prefetch(env: Mapping[str, str], out=sys.stdout) -> int:
    if knob(env, "ORCH_SMOKE", "off") == "on":
        print("[orch] prefetch: ORCH_SMOKE=on: the nodes build the tiny model and data, nothing to download", file=out,
              flush=True)  # fmt: skip
        return 0
    trl = configs.load_yaml(Path(configs.required(env, "TRL_CONFIG", "recipes/trl/phi3_dpo.yaml")), "TRL config")
    settings = overrides.effective(trl, overrides.loads(env.get("TRL_OVERRIDES", "")))
    if not sys.stderr.isatty():  # a log (SkyPilot's, shared with the rehearsal): whole lines, not redrawn bars; set
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before huggingface_hub's import reads it
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    wanted = repos(settings)
    for name in streamed(settings):
        from huggingface_hub import constants

        if not Path(name).exists() and constants.HF_HUB_OFFLINE:
            key = _streaming_key(settings)
            raise OrchError(f"dataset {name} is streamed ({key}) from the Hub as the ranks train, and HF_HUB_OFFLINE=1 "
                            f"keeps the nodes off the Hub: set {key}=false (the setup then reads it from the cache) or "
                            "unset HF_HUB_OFFLINE")  # fmt: skip
        print(f"[orch] prefetch: dataset {name} is streamed by the ranks as they train: not downloaded", file=out,
              flush=True)  # fmt: skip
    attention, allow_all = attention_names.requested(settings)
    kernel = attention_kernel.repo(attention) if attention_names.may_need_hub(attention) else None
    if kernel:
        wanted.append(Repo(kernel.split(":")[0].split("@")[0], "kernel", None, "attention kernel", kernel))
    if not wanted:
        print("[orch] prefetch: the model and data are local paths or streamed: nothing to download", file=out,
              flush=True)  # fmt: skip
        return 0
    token = env.get("HF_TOKEN") or None
    started = time.monotonic()
    done = threading.Event()
    every = knob(env, "ORCH_PREFETCH_PROGRESS_S", PROGRESS_EVERY)
    reporter = threading.Thread(target=_progress, args=(wanted, started, every, done, out), daemon=True)
    reporter.start()
    try:
        with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
            results = list(pool.map(lambda repo: _get(repo, token, attention, allow_all, out), wanted))
    finally:
        done.set()
    for repo, (path, size) in zip(wanted, results, strict=True):
        loaded = f", loaded ({Path(path).name} build)" if repo.repo_type == "kernel" and path else ""
        print(f"[orch] prefetch: {repo.why} {repo.repo_id}: {size / 1e9:.2f} GB in the cache{loaded}", file=out,
              flush=True)  # fmt: skip
    print(f"[orch] prefetch: {len(wanted)} repo(s) in {time.monotonic() - started:.1f} s", file=out, flush=True)
    return 0


def _get(repo: Repo, token: str | None, attention: str | None, allow_all: bool, out) -> tuple[str, int]:
    if repo.repo_type == "kernel":  # `config` holds the name transformers loads (org/name[@rev][:function])
        from huggingface_hub import constants

        def once() -> tuple[str, int]:
            return attention_kernel.fetch(str(repo.config), str(attention), allow_all)

        try:
            return once() if constants.HF_HUB_OFFLINE else tried(repo, token, once, out)
        except attention_kernel.NotCached as exc:
            raise _not_cached(str(exc)) from None
    return fetch(repo, token, out)


def main(argv: list[str] | None = None) -> int:
    """`--times FILE`: append `prefetched=<epoch seconds>` to it on success, `error=<the error line>` on a refusal
    instead of printing it (scripts/node-setup.sh's timings file; the download runs beside the rehearsal, so it records
    its own end, and the setup prints the first error)."""
    args = sys.argv[1:] if argv is None else argv
    times = args[1] if len(args) == 2 and args[0] == "--times" else None
    if args and times is None:
        print("orch: error: usage: python -m orchestrator.train.prefetch [--times FILE]", file=sys.stderr, flush=True)
        return 2
    from orchestrator.core.home import shared_caches
    from orchestrator.core.timeline import record

    caches = shared_caches(os.environ)
    os.environ.update(caches)  # before huggingface_hub reads HF_HOME
    if "HF_HOME" in caches:
        print(f"[orch] prefetch: into HF_HOME={caches['HF_HOME']} (the account's home: SkyPilot's $HOME on Slurm is "
              "per cluster)", flush=True)  # fmt: skip
    try:
        code = prefetch(os.environ)
    except OrchError as exc:
        if times:  # node-setup.sh prints the first recorded error once, last, whichever of its two jobs failed
            record(times, "error", f"orch: error: {exc}")
        else:
            print(f"orch: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    if code == 0:
        record(times, "prefetched")
    return code


if __name__ == "__main__":
    sys.exit(main())
