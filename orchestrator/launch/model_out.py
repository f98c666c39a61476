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
        raise OrchError(f"could not download {repo} from the Hub ({why}); a private repo needs HF_TOKEN here") from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping for local_dir downloads
