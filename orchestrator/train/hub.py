"""The final model out to the Hugging Face Hub (`orch run --push-to-hub REPO` sets ORCH_PUSH_TO_HUB on the nodes).

The main process creates the repo (private) before training starts, so a token without write access fails in
seconds, not after the run; after the final save it uploads the final model's files only (weights, config,
tokenizer, or the LoRA adapter), never checkpoints or orch's reports, with huggingface_hub's upload_folder; then
it lists the repo back and reports what is there. HF_TOKEN comes from the environment (a SkyPilot secret).
Transformers' own push_to_hub is not used: it uploads the whole output_dir but checkpoints, orch/ included.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.core.final_model import FILES

ENV = "ORCH_PUSH_TO_HUB"


def repo() -> str | None:
    return os.environ.get(ENV) or None


def _why(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def prepare(repo_id: str) -> None:
    from huggingface_hub import HfApi

    try:
        HfApi().create_repo(repo_id, private=True, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - the Hub's refusal, in one line, before any training
        raise RuntimeError(f"--push-to-hub {repo_id}: the Hub refused the repo ({_why(exc)}); check that HF_TOKEN "
                           "can write there") from None  # fmt: skip


def push(repo_id: str, output_dir: Path) -> dict:
    """Upload the final model; what the Hub then lists is what is reported."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(output_dir), allow_patterns=list(FILES),
                                   ignore_patterns=["*/*"], commit_message="orch: final model")  # top level only
        files = sorted(api.list_repo_files(repo_id))
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"--push-to-hub {repo_id}: upload failed ({_why(exc)}); the model is still in "
                           f"{output_dir}") from None  # fmt: skip
    return {"repo": repo_id, "url": f"{api.endpoint}/{repo_id}", "commit": commit.oid, "files": files}
