"""A model's family from its own config.json, which names its architecture (`model_type`) where its id does not.

Smoke mode and the rehearsal build a tiny model of the training model's family (core/models.FAMILIES), and the FSDP
wrap check names its decoder layer. Chosen by the id's name alone, a user's own model directory
(`model_name_or_path=outputs/my-sft/final`) or a fine-tune named for itself (a Qwen2 called OpenThinker-7B) was
refused on the head node after the cluster was up, and skipped the laptop's rehearsal on the way there; and a name
that says its family but not its variant (Qwen/Qwen3-30B-A3B is `qwen3_moe`) was rehearsed as the dense model.
config.json says it: a local directory's, or the Hub's, fetched with huggingface_hub (its cache where it has the
file: the node's download fetches it anyway; one small file, within DEADLINE_S). The models the recipes name
(core/models.KNOWN_ARCHS) are known by name and need no lookup. Where config.json cannot be read (a laptop off the
Hub, a gated model without HF_TOKEN), the name decides as before, and where it does not either, `Unknown` says why.
Used on both sides: the launch side (checks, preflight, the local backend's smoke mode) and the head node.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import files, models
from orchestrator.core.errors import OrchError

DEADLINE_S = 20.0
"""How long the Hub may take to hand over config.json (huggingface_hub retries a failed request 5 times)."""


class Unknown(OrchError):
    """Neither the model's config.json nor its name says its family."""


class Found(NamedTuple):
    config: Mapping | None
    """The model's config.json, or None where it was not read."""
    why: str = ""
    """Why not, in words ('' where no lookup was needed: a model orch knows by name)."""
    where: str = ""
    """Where it was read, for the messages: the file, or the Hub repo's config.json."""


def family(model_id: str, revision: object = None) -> models.Family:
    """The family of the model the TRL settings name (model_name_or_path, model_revision): by its config.json's
    model_type where it can be read, else by its name. An OrchError where config.json names a model_type orch builds no
    tiny model of; `Unknown` where neither says."""
    found = read(model_id, revision)
    if found.config is not None:
        return models.family_of(model_id, found.config, found.where)
    try:
        return models.family_of(model_id)
    except OrchError as exc:
        if not found.why:
            raise Unknown(str(exc)) from None
        known = ", ".join(f.model_type for f in models.FAMILIES)
        raise Unknown(f"model {model_id!r}: neither its name nor its config.json says which family ({known}) it is "
                      f"of: config.json not read, {found.why}") from None  # fmt: skip


def loads_as(model_id: str, revision: object = None) -> str | None:
    """The TRL setting the model's bitsandbytes-quantised checkpoint loads as (core/models.quantized: `load_in_4bit`,
    `load_in_8bit`), None for a full-precision one or one whose config.json was not read; an OrchError for another
    quantisation method."""
    found = read(model_id, revision)
    return models.quantized(model_id, found.config, found.where)


def is_path(model_id: str) -> bool:
    """The model is a path (a local directory, one on the nodes), not a Hub id: nothing to download."""
    return model_id.startswith(("/", "./", "../", "~")) or Path(model_id).exists()


def read(model_id: str, revision: object = None) -> Found:
    """model_id's config.json: a local directory's (or a config.json path), or the Hub's at revision (TRL's
    model_revision, as the settings hold it); none for a model orch knows by name. Read once per process."""
    return _read(model_id, None if revision in (None, "") else str(revision))


def forget() -> None:
    """Read again at the next ask (tests)."""
    _read.cache_clear()


@functools.lru_cache(maxsize=32)
def _read(model_id: str, revision: str | None) -> Found:
    path = Path(model_id)
    if model_id and path.exists():
        config = path / "config.json" if path.is_dir() else path
        if not (config.name.endswith(".json") and config.is_file()):
            return Found(None, f"{path} is not a directory holding a config.json, nor one")
        loaded = files.load_json(config, "model config")
        if not isinstance(loaded, Mapping):
            raise OrchError(f"model config {config} is not a JSON object; point model_name_or_path at a model")
        return Found(loaded, where=str(config))
    if not model_id or model_id.lower() in models.KNOWN_ARCHS:
        return Found(None)
    return _from_hub(model_id, revision)


def _from_hub(model_id: str, revision: str | None) -> Found:
    try:
        from huggingface_hub import hf_hub_download, utils
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        return Found(None, "huggingface_hub is not installed here")
    utils.logging.set_verbosity_error()  # its retry lines ("Retrying in 1s [Retry 1/5]") are not orch's to print
    utils.disable_progress_bars()
    answer: list = []

    def fetch() -> None:
        try:  # the cache first: a stale config.json still names the architecture, and a failed link skips the cache
            answer.append(hf_hub_download(model_id, "config.json", revision=revision, local_files_only=True))
            return
        except LocalEntryNotFoundError:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which words it
            answer.append(exc)
            return
        try:
            answer.append(hf_hub_download(model_id, "config.json", revision=revision))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which words it
            answer.append(exc)

    worker = threading.Thread(target=fetch, name="orch-model-config", daemon=True)
    worker.start()
    worker.join(DEADLINE_S)
    if not answer:
        return Found(None, f"the Hub did not answer within {DEADLINE_S:.0f} s")
    got = answer[0]
    if isinstance(got, str):
        loaded = files.load_json(got, "model config")
        if not isinstance(loaded, Mapping):
            raise OrchError(f"{model_id}'s config.json on the Hub is not a JSON object; check model_name_or_path")
        return Found(loaded, where=f"{model_id}'s config.json")
    at = f" at revision {revision}" if revision else ""
    # the first that matches: a GatedRepoError is also a RepositoryNotFoundError, a LocalEntryNotFoundError an
    # EntryNotFoundError
    reasons = (
        (HFValidationError, f"{model_id!r} is neither a local path nor a Hub id"),
        (GatedRepoError, f"{model_id} is gated (set HF_TOKEN, or pass --secret HF_TOKEN)"),
        (RevisionNotFoundError, f"{model_id} has no revision {revision}"),
        (RepositoryNotFoundError, f"{model_id} is not on the Hub, or is private (set HF_TOKEN)"),
        (LocalEntryNotFoundError, f"the Hub cannot be reached from here and its cache has no {model_id}{at}"),
        (EntryNotFoundError, f"{model_id}{at} has no config.json"),
    )
    for kind, reason in reasons:
        if isinstance(got, kind):
            return Found(None, reason)
    if _unreachable(got):
        return Found(None, f"the Hub cannot be reached from here and its cache has no {model_id}{at}")
    said = " ".join(str(got).split())[:200]
    return Found(None, f"no answer from the Hub ({type(got).__name__}: {said})")



def _unreachable(exc: BaseException) -> bool:
    """The link to the Hub failed (not the Hub's answer): httpx's transport errors, and huggingface_hub 1.16's closed
    client, which its retry raises in place of the connection's error (train/hub_link.CLOSED_CLIENT, the prefetch's
    reading of the same)."""
    import httpx

    if isinstance(exc, RuntimeError):
        return "Cannot send a request, as the client has been closed" in str(exc)
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))
