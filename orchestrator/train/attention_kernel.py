"""The attention kernel a recipe's ranks would fetch from the Kernels Hub as they load the model: fetched and loaded
once per node in its setup instead (train/prefetch.py runs it beside the model's and the data's downloads). Which
attention the ranks ask for, and whether it may be a Hub kernel: core/attention.py.

transformers 5.x loads an `attn_implementation` named like a Hub repo (`kernels-community/flash-attn2`, `org/name@rev`,
`org/name:function`) with the `kernels` package (orch's `gpu` extra), and falls back to kernels-community's flash
attention for `flash_attention_2/3/4` where the flash-attn package is not installed (uv.lock installs none). Every rank
did that in `from_pretrained`, after the launch: a node with no route to the Hub, no build of the kernel for the node's
torch and CUDA, a GPU the build does not support, a publisher the Hub does not trust or a setup without the `kernels`
package failed on every rank once the cluster was paid for. Here the setup runs transformers' own loader on it
(`lazy_import_flash_attention`, what the rank's `from_pretrained` calls): the kernel lands in the Hugging Face cache the
ranks read, the build variant is the one they pick, its import and GPU check run, and a refusal is one line.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.core.attention import TRUST_FIX
from orchestrator.core.errors import OrchError
from orchestrator.train.hub_link import hub_failure, link_error, said


class NotCached(Exception):
    """HF_HUB_OFFLINE=1 and the kernel is not in the cache (its argument: what to call it); train/prefetch.py words it
    as it words a model or a dataset the cache lacks."""


def repo(attention: str) -> str | None:
    """The Kernels Hub repo transformers loads for `attention` on this node, or None; an OrchError where a rank's load
    would find neither the flash-attn package nor the `kernels` package."""
    from transformers import modeling_flash_attention_utils as flash
    from transformers.integrations import hub_kernels

    if hub_kernels.is_kernel(attention):
        found = attention
    elif attention in flash.FLASH_ATTN_KERNEL_FALLBACK:
        matrix = flash.FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(int(attention[-1]), {})
        if matrix and matrix["general_availability_check"]():
            return None  # the flash-attn package itself
        found = flash.FLASH_ATTN_KERNEL_FALLBACK[attention]
    else:
        return None
    if not hub_kernels.is_kernels_available():
        raise OrchError(
            f"attn_implementation {attention} loads the Kernels Hub kernel {found.split(':')[0]}, but this node has no "
            "kernels package in the version transformers accepts: install orch's gpu extra (the recipe's setup: bash "
            "scripts/node-setup.sh train,gpu), or set attn_implementation=sdpa"
        )
    return found


def fetch(name: str, attention: str, allow_all: bool) -> tuple[str, int]:
    """(the kernel's build folder in the cache, its bytes): downloaded (or, with HF_HUB_OFFLINE=1, found in the cache)
    and imported by transformers' loader as a rank's from_pretrained does; or an OrchError quoting why not."""
    from huggingface_hub import constants
    from transformers import modeling_flash_attention_utils as flash
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on inference (continuous batching's block tables) say nothing here
    try:
        flash.lazy_import_flash_attention(name, allow_all_kernels=allow_all)
    except (ImportError, ValueError, OSError, RuntimeError) as exc:
        # transformers records the name as loaded before it loads: another try in this process would load nothing
        flash._loaded_implementation = None
        link = None if constants.HF_HUB_OFFLINE else link_error(exc)
        if link is not None:  # the network's, not the kernel's: the prefetch tries again (train/prefetch.tried)
            raise link from None
        raise _refusal(name, attention, exc, constants.HF_HUB_OFFLINE) from None
    import kernels

    repo_id, _, revision = name.split(":")[0].partition("@")
    for loaded in kernels.get_loaded_kernels():
        if loaded.repo_info is not None and loaded.repo_info.repo_id == repo_id:
            folder = Path(loaded.module.__file__).parent  # build/<variant>/ or build/<variant>/<module>/
            variant = folder if folder.parent.name == "build" else folder.parent
            if not revision and not constants.HF_HUB_OFFLINE:
                try:
                    _keep_version(repo_id, variant.name)
                except Exception as exc:  # noqa: BLE001 - only an offline rank needs the ref: said, not fatal
                    print(f"[orch] prefetch: attention kernel {repo_id}: its version's ref not kept "
                          f"({type(exc).__name__}): a rank with HF_HUB_OFFLINE=1 would not find it in this cache",
                          flush=True)  # fmt: skip
            return str(variant), sum(p.stat().st_size for p in variant.rglob("*") if p.is_file())
    return "", 0  # a local kernel (LOCAL_KERNELS): nothing in the cache


def _keep_version(repo_id: str, variant: str) -> None:
    """Record in the cache which commit the kernel's version branch (vN) names, so that a rank with HF_HUB_OFFLINE=1 (a
    node whose cache was filled by this setup elsewhere) finds the version it asks for. The kernels package (0.16)
    resolves version N to a commit on the Hub and downloads that commit, so huggingface_hub writes no refs/vN, and
    offline it reads only refs/vN ('Version N of ... is not available in the local cache'). A download by the branch's
    name writes it, fetching nothing new (tests/test_node_setup.py fails once the kernels package writes it itself)."""
    from huggingface_hub import HfApi
    from kernels.utils import _BYTECODE_IGNORE_PATTERNS, CACHE_DIR  # the kernels package's own download's arguments
    from transformers.integrations import hub_kernels

    version = hub_kernels.get_attn_kernel_version(repo_id)  # what transformers asks the kernels package for
    HfApi().snapshot_download(
        repo_id, repo_type="kernel", revision=f"v{version}", allow_patterns=[f"build/{variant}/*"],
        ignore_patterns=_BYTECODE_IGNORE_PATTERNS, cache_dir=CACHE_DIR,
    )  # fmt: skip


def _refusal(name: str, attention: str, exc: BaseException, offline: bool) -> Exception:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cause = exc
    if str(exc).startswith("An error occurred while trying to load from") and exc.__context__ is not None:
        cause = exc.__context__  # transformers wraps the kernels package's error: quote that one
    quoted = said(cause, 300)
    what = f"attention kernel {name}" + (f" (attn_implementation {attention})" if attention != name else "")
    if isinstance(cause, GatedRepoError | RepositoryNotFoundError):
        return OrchError(
            f"{what} does not exist on the Hugging Face Hub (or this node may not read it: give HF_TOKEN); check "
            "attn_implementation in the TRL config"
        )
    if offline and ("local cache" in quoted or "local snapshot" in quoted):
        return NotCached(what)
    unanswered = hub_failure(cause) if "could not verify publisher trust" in quoted else None
    if unanswered is not None:  # the kernels package asks the Hub about the publisher and wraps any failure
        status, answered = unanswered
        return OrchError(f"{what} cannot be loaded on this node: the Hub failed to say whether its publisher is "
                         f"trusted (HTTP {status}: {answered}); run the setup again later, or check HF_ENDPOINT")
    if "trusted publisher" in quoted or "publisher trust" in quoted:
        quoted = quoted.split(". Set trust_remote_code")[0]  # the kernels package's knob; the recipe's is below
        fix = TRUST_FIX
    elif "build variant" in quoted:
        fix = "it has no build for this node's torch, accelerator and platform: choose another attn_implementation"
    elif "not supported by the architectures" in quoted:
        fix = "its build does not run on this node's GPU: choose another accelerator or attn_implementation"
    else:
        fix = "check attn_implementation in the TRL config, and the node's route to the Hub (HF_ENDPOINT)"
    return OrchError(f"{what} cannot be loaded on this node, as every rank would load it: {type(cause).__name__}: "
                     f"{quoted}; {fix}")  # fmt: skip

