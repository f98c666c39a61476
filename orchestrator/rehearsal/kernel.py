"""A recipe's Kernels Hub attention kernel, checked on the laptop before a GPU is paid for (`orch run`, cloud launches).

`python -m orchestrator.rehearsal.kernel '<json>'` takes {attention, allow_all, torch, cuda, cpu} as its argument
and prints one line, `ORCH_KERNEL <json>`: {"line": ...} where a rank could load it, {"fatal": ...} where none could
(the launch stops), {"note": ...} where it was not checked (no kernels package or transformers here, no answer from
the Hub). The owners' code decides, as on the node: transformers' names (the flash attention fallback repo, the
kernel version it asks for), the kernels package's version refs, publisher trust check and build-variant resolution,
given the system the nodes will have (uv.lock's torch and CUDA, the accelerator's CPU) instead of this machine's. The
node's setup still fetches and loads the kernel for real (train/attention_kernel.py): it alone sees the GPU's
architecture and a CUDA other than the lock's (an image's own torch). A run of its own: launch-side `orch` never
imports the training stack (launch/kernelcheck.py calls it).
"""

from __future__ import annotations

import json
import sys

from orchestrator.core.attention import TRUST_FIX
from orchestrator.rehearsal.data import answer

FIX_NAME = "check attn_implementation in the TRL config"


def check(request: dict) -> dict:
    attention, allow_all = str(request["attention"]), bool(request.get("allow_all"))
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
        from kernels import _versions, utils
        from kernels import variants as kv
        from kernels.archs import _supports_cuda_capability as supports
        from kernels.backends import CUDA
        from packaging.version import Version
        from transformers.integrations import hub_kernels
        from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK

        from orchestrator.train.hub_link import hub_failure, link_error, said
    except ImportError as exc:  # the kernels package comes with the gpu extra, on Linux only; transformers with train
        missing = (exc.name or "kernels").split(".")[0]
        get = "pip install kernels" if missing in ("kernels", "kernels_data") else "pip install '.[train]'"
        return {"note": f"attention kernel {attention}: not checked here (no {missing} package: {get} to check it "
                        "before launch); the node's setup loads it"}  # fmt: skip
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return {"note": f"attention kernel {attention}: not checked (HF_HUB_OFFLINE=1 here)"}
    # the nodes install no flash-attn package (uv.lock has none): transformers loads its Kernels Hub fallback there
    name = FLASH_ATTN_KERNEL_FALLBACK.get(attention, attention)
    if not hub_kernels.is_kernel(name):
        return {}
    repo_id, _, revision = (part.strip() for part in name.split(":")[0].partition("@"))
    what = f"attention kernel {repo_id}" + (f" (attn_implementation {attention})" if attention != name else "")
    version = None if revision else hub_kernels.get_attn_kernel_version(repo_id)  # what transformers asks for
    system = f"uv.lock's torch {request['torch']} + CUDA {request['cuda']} on {request['cpu']}-linux"
    stage = "its versions"
    try:
        resolved = _versions.select_revision_or_version(repo_id, revision=revision or None, version=version)
        if not allow_all:
            stage = "its publisher"
            utils._check_trust_remote_code(repo_id, False)  # what get_kernel runs first on every rank
        stage = "its builds"
        found = kv.get_variants(HfApi(), repo_id=repo_id, revision=resolved)
    except (GatedRepoError, RepositoryNotFoundError):
        return {"fatal": f"{what} does not exist on the Hugging Face Hub, or this machine may not read it (HF_TOKEN); "
                         f"{FIX_NAME}, or ORCH_KERNEL_CHECK=off to launch without this check"}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the network's, the Hub's or the kernel's: told apart below
        link, failed = link_error(exc), hub_failure(exc)
        if link is not None:  # the kernels package wraps it ('could not verify publisher trust status')
            return {"note": f"{what}: not checked (cannot reach the Hub from here: {type(link).__name__}: "
                            f"{said(link)})"}  # fmt: skip
        if failed is not None:
            return {"note": f"{what}: not checked (the Hub failed to answer about {stage}: HTTP {failed[0]})"}
        quoted = said(exc)
        if "trusted publisher" in quoted or "publisher trust" in quoted:
            return {"fatal": f"{what} is not from a publisher the Hub trusts, and the ranks load only those; "
                             f"{TRUST_FIX}"}  # fmt: skip
        if "not found, available versions" in quoted:
            available = quoted.split(": ")[-1]
            return {"fatal": f"{what}: transformers asks for version {version}, and the repo has {available} only; "
                             f"name a revision (attn_implementation={repo_id}@<branch or commit>)"}  # fmt: skip
        return {"fatal": f"{what} cannot be loaded, as every rank would load it ({stage}): {type(exc).__name__}: "
                         f"{quoted}; {FIX_NAME}"}  # fmt: skip
    accepted, trace = kv._resolve_variant_for_system(
        variants=found, selected_backend=CUDA(version=Version(str(request["cuda"]))), cpu=str(request["cpu"]),
        os="linux", torch_version=Version(str(request["torch"])), torch_cxx11_abi=True, tvm_ffi_version=None,
    )  # fmt: skip
    label = f"version {version}" if version is not None else f"revision {revision}"
    if not accepted:
        why = "; ".join(f"{d.variant.variant_str}: {d.reason}" for d in trace[:3]) or "it has no builds"
        more = f" (and {len(trace) - 3} more)" if len(trace) > 3 else ""
        return {"fatal": f"{what} at {label} has no build for {system}, so no rank could load it ({why}{more}); "
                         "choose another attn_implementation, e.g. sdpa"}  # fmt: skip
    variant = accepted[0].variant_str  # the one the kernels package picks on the node, and checks the GPU against
    runs_on = ""
    if request.get("capability"):
        try:
            archs = _archs(repo_id, resolved, variant)
        except Exception as exc:  # noqa: BLE001 - its metadata unread: the node checks the GPU itself
            archs, runs_on = None, f"; the GPU not checked (its metadata: {type(exc).__name__})"
        gpu, capability = request["accelerator"], tuple(int(x) for x in str(request["capability"]).split("."))
        if archs and not supports(archs, capability):
            return {"fatal": f"{what} at {label}: its build {variant} declares CUDA capabilities {', '.join(archs)}, "
                             f"and a {gpu} is {request['capability']}, so every rank's load refuses it; choose an "
                             "accelerator it declares, or another attn_implementation, e.g. sdpa"}  # fmt: skip
        if archs:
            runs_on = f", which declares the {gpu}'s CUDA capability {request['capability']}"
    trust = "any publisher (allow_all_kernels)" if allow_all else "a trusted publisher"
    return {"line": f"{what}: {label}, {trust}, build {variant} for {system}{runs_on}; the node's setup fetches and "
                    "loads it"}  # fmt: skip


def _archs(repo_id: str, revision: str, variant: str) -> list[str] | None:
    """The CUDA capabilities the build declares (its metadata.json, one small file, as the kernels package's has_kernel
    reads it), or None where it declares none."""
    from huggingface_hub import hf_hub_download
    from kernels.utils import CACHE_DIR
    from kernels_data import Metadata

    path = hf_hub_download(repo_id, f"build/{variant}/metadata.json", repo_type="kernel", revision=revision,
                           cache_dir=CACHE_DIR)  # fmt: skip
    return Metadata.read_from_file(path).backend.archs


def main() -> None:
    request = json.loads(sys.argv[1])
    answer("ORCH_KERNEL", lambda: check(request))


if __name__ == "__main__":
    main()
