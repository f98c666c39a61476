"""The final model back from the Hub (`orch pull`), with huggingface_hub's own client."""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.core.errors import OrchError


def download(repo: str, dest: Path) -> None:
    """The final model's files of a Hub repo (`orch pull` of a --push-to-hub run)."""
    from huggingface_hub import snapshot_download

    from orchestrator.core.final_model import FILES

    try:
        snapshot_download(repo, local_dir=str(dest), allow_patterns=list(FILES), ignore_patterns=["*/*"])
    except Exception as exc:  # noqa: BLE001 - the Hub's answer, in one line
        why = " ".join(str(exc).split())[:300]
        fix = "a private repo needs HF_TOKEN here"
        if _network(exc):
            fix = "this machine could not reach the Hub: check its network (or HF_ENDPOINT) and run `orch pull` again"
        raise OrchError(f"could not download {repo} from the Hub ({why}); {fix}") from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping for local_dir downloads


def _network(exc: BaseException | None) -> bool:
    """Whether the connection failed, anywhere in the exception's chain (huggingface_hub wraps it)."""
    import httpx

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
