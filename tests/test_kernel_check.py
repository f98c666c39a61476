"""The attention kernel a recipe's ranks load from the Kernels Hub, checked before a cloud launch with the owners' code
(transformers' names and versions, the kernels package's refs, publisher trust and build-variant resolution) against
the stand-in Hub, for the nodes' torch and CUDA from uv.lock (launch/kernelcheck.py, rehearsal/kernel.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, orch
from hub_standin import Hub, save_kernel

from orchestrator.launch import kernelcheck

NODES = {"torch": "2.13", "cuda": "13.0", "cpu": "x86_64"}  # uv.lock's, as kernelcheck.locked reads them


@pytest.mark.unit
def test_the_nodes_torch_and_cuda_are_read_from_the_lock_they_install(tmp_path):
    assert kernelcheck.locked(ROOT) == ("2.13", "13.0")  # torch 2.13.0, its Linux wheel's cuda-toolkit 13.0.3.0
    (tmp_path / "uv.lock").write_text('version = 1\n[[package]]\nname = "torch"\nversion = "2.13.0"\n')
    assert kernelcheck.locked(tmp_path) is None  # no cuda-toolkit: not a CUDA torch, nothing to resolve against
    (tmp_path / "uv.lock").write_bytes(b"\xff[[package]\n")
    assert kernelcheck.locked(tmp_path) is None
    assert kernelcheck.locked(tmp_path / "nowhere") is None


@pytest.fixture
def hub(tmp_path):
    """kernels-community's flash-attn2 with a CPU build only and its flash-attn4 at versions 1-3 (transformers asks
    for 0); kernels with a CUDA build for uv.lock's torch, for an older torch and CUDA, and for aarch64; one from a
    publisher the Hub does not trust."""
    root = tmp_path / "hub"
    save_kernel(root, "kernels-community/flash-attn2")
    save_kernel(root, "kernels-community/flash-attn4", "torch213-cxx11-cu130-x86_64-linux")
    save_kernel(root, "kernels-community/cuda-flash", "torch213-cxx11-cu130-x86_64-linux")
    save_kernel(root, "kernels-community/old-flash", "torch212-cxx11-cu128-x86_64-linux")
    save_kernel(root, "kernels-community/old-flash", "torch213-cxx11-cu130-aarch64-linux")
    save_kernel(root, "someone/cuda-flash", "torch213-cxx11-cu130-x86_64-linux")
    (root / "models").mkdir()
    with Hub(root) as server:
        yield server


@pytest.mark.e2e  # imports transformers and the kernels package
def test_a_kernel_no_rank_could_load_is_refused_before_launch_by_the_owners_code(hub, monkeypatch):
    from huggingface_hub import constants

    from orchestrator.rehearsal import kernel

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)

    def check(attention: str, allow_all: bool = False, **system: str) -> dict:
        return kernel.check({"attention": attention, "allow_all": allow_all, **NODES, **system})

    system = "uv.lock's torch 2.13 + CUDA 13.0 on x86_64-linux"
    assert check("kernels-community/cuda-flash") == {
        "line": f"attention kernel kernels-community/cuda-flash: version 1, a trusted publisher, build "
        f"torch213-cxx11-cu130-x86_64-linux for {system}; the node's setup fetches and loads it"
    }
    # flash_attention_2: no flash-attn package on the nodes, so transformers' fallback repo at the version it asks (3)
    assert check("flash_attention_2") == {
        "fatal": "attention kernel kernels-community/flash-attn2 (attn_implementation flash_attention_2) at version 3 "
        f"has no build for {system}, so no rank could load it (torch-cpu: backend (cpu) does not match system "
        "backend (cuda) and is not universal); choose another attn_implementation, e.g. sdpa"
    }
    refused = check("kernels-community/old-flash")["fatal"]
    assert refused.startswith(f"attention kernel kernels-community/old-flash at version 1 has no build for {system}")
    assert "torch212-cxx11-cu128-x86_64-linux: Torch version (2.12) does not match environment Torch version " \
        "(2.13)" in refused and "torch213-cxx11-cu130-aarch64-linux: CPU (aarch64) does not match system CPU " \
        "(x86_64)" in refused  # fmt: skip
    assert "build torch213-cxx11-cu130-aarch64-linux " in check("kernels-community/old-flash", cpu="aarch64")["line"]
    assert "fatal" in check("kernels-community/cuda-flash", cuda="12.8")  # CUDA 12 nodes cannot load a cu130 build
    assert check("someone/cuda-flash") == {
        "fatal": "attention kernel someone/cuda-flash is not from a publisher the Hub trusts, and the ranks load only "
        'those; set model_init_kwargs={"allow_all_kernels": true} if you trust its code, or another attn_implementation'
    }
    assert check("someone/cuda-flash", allow_all=True)["line"].startswith(
        "attention kernel someone/cuda-flash: version 1, any publisher (allow_all_kernels), build "
    )
    # flash_attention_4: transformers asks for version 0 of its kernel (FA4 is in beta); this repo has 1-3 only
    assert check("flash_attention_4") == {
        "fatal": "attention kernel kernels-community/flash-attn4 (attn_implementation flash_attention_4): transformers "
        "asks for version 0, and the repo has 1, 2, 3 only; name a revision "
        "(attn_implementation=kernels-community/flash-attn4@<branch or commit>)"
    }
    assert check("kernels-community/nope") == {
        "fatal": "attention kernel kernels-community/nope does not exist on the Hugging Face Hub, or this machine may "
        "not read it (HF_TOKEN); check attn_implementation in the TRL config, or ORCH_KERNEL_CHECK=off to launch "
        "without this check"
    }
    assert check("kernels-community/cuda-flash@v2")["line"].startswith(
        "attention kernel kernels-community/cuda-flash: revision v2, a trusted publisher"
    )
    assert check("sdpa") == {}
    # the Hub's own failure and a Hub that cannot be reached are notes: the kernel is not at fault
    hub.unavailable = 1
    assert check("kernels-community/cuda-flash") == {
        "note": "attention kernel kernels-community/cuda-flash: not checked (the Hub failed to answer about its "
        "versions: HTTP 503)"
    }
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert check("kernels-community/cuda-flash")["note"].startswith(
        "attention kernel kernels-community/cuda-flash: not checked (cannot reach the Hub from here: ConnectError: "
    )


@pytest.mark.e2e  # a dry run, and the check's process imports transformers
def test_orch_run_refuses_a_missing_kernel_before_anything_is_written(hub, project):
    """The launch side runs the check in a process of its own beside the data check, for a cloud launch and its dry
    run: a kernel no rank could load stops it (exit 2, one line, nothing written); a good one is one line."""
    shutil.copy(ROOT / "uv.lock", project / "uv.lock")  # the recipe's workdir: what the nodes install
    env = {"ORCH_KERNEL_CHECK": "on", "HF_ENDPOINT": hub.endpoint}
    argv = ["run", "qwen25_sft_ddp", "--dry-run", "--skip-optimizer"]
    refused = orch(*argv, "attn_implementation=kernels-community/nope", cwd=project, env=env)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "orch: error: attention kernel kernels-community/nope does not exist on the Hugging Face Hub"
    )
    assert not (project / "sky_jobs").exists() and not Path(project / "outputs").exists()
    done = orch(*argv, "attn_implementation=kernels-community/cuda-flash", cwd=project, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    said = "[orch] attention kernel kernels-community/cuda-flash: version 1, a trusted publisher, build torch213-"
    assert f"{said}cxx11-cu130-x86_64-linux for uv.lock's torch 2.13 + CUDA 13.0 on x86_64-linux" in done.stdout
