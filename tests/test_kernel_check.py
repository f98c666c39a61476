"""The attention kernel a recipe's ranks load from the Kernels Hub, checked before a cloud launch with the owners' code
(transformers' names and versions, the kernels package's refs, publisher trust and build-variant resolution) against
the stand-in Hub, for the nodes' torch and CUDA from uv.lock (launch/kernelcheck.py, rehearsal/kernel.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


@pytest.mark.cli
def test_a_laptop_without_the_kernels_package_gets_a_note_naming_how_to_check(monkeypatch):
    """The kernels package comes with the gpu extra, on Linux only: a Mac laptop has none, and its launch goes on."""
    from orchestrator.rehearsal import kernel

    monkeypatch.setitem(sys.modules, "kernels", None)  # `import kernels` raises ModuleNotFoundError, as when missing
    assert kernel.check({"attention": "org/x", "allow_all": False, **NODES}) == {
        "note": "attention kernel org/x: not checked here (no kernels package: pip install kernels to check it before "
        "launch); the node's setup loads it"
    }


@pytest.fixture
def hub(tmp_path):
    """kernels-community's flash-attn2 with a CPU build only and its flash-attn4 at versions 1-3 (transformers asks
    for 0); kernels with a CUDA build for uv.lock's torch, for an older torch and CUDA, and for aarch64; one from a
    publisher the Hub does not trust."""
    root = tmp_path / "hub"
    save_kernel(root, "kernels-community/flash-attn2")
    save_kernel(root, "kernels-community/flash-attn4", "torch213-cxx11-cu130-x86_64-linux")
    save_kernel(root, "kernels-community/cuda-flash", "torch213-cxx11-cu130-x86_64-linux", archs=["8.0", "9.0"])
    save_kernel(root, "kernels-community/old-flash", "torch212-cxx11-cu128-x86_64-linux")
    save_kernel(root, "kernels-community/old-flash", "torch213-cxx11-cu130-aarch64-linux")
    save_kernel(root, "someone/cuda-flash", "torch213-cxx11-cu130-x86_64-linux")
    (root / "models").mkdir()
    with Hub(root) as server:
        yield server


CHECK = "import json, sys; from orchestrator.rehearsal import kernel; " \
    "print(json.dumps([kernel.check(r) for r in json.loads(sys.argv[1])]))"  # fmt: skip


def checked(endpoint: str, home: Path, *cases: tuple[str, dict]) -> list[dict]:
    """rehearsal/kernel.check's answers to (attn_implementation, what else the request holds) on uv.lock's system, in
    one process whose huggingface_hub asks `endpoint` (HF_ENDPOINT, read at its import) and caches under `home`."""
    requests = [{"attention": attention, "allow_all": False, **NODES, **extra} for attention, extra in cases]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run([sys.executable, "-c", CHECK, json.dumps(requests)], capture_output=True, text=True,
                          env={**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home)}, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e  # processes that import transformers and the kernels package
def test_a_kernel_no_rank_could_load_is_refused_before_launch_by_the_owners_code(hub, tmp_path):
    cuda, h100, t4, b200, fa2, old, old_arm, cuda12, untrusted, allowed, fa4, nope, pinned, sdpa = checked(
        hub.endpoint, tmp_path / "hf",
        ("kernels-community/cuda-flash", {}),
        ("kernels-community/cuda-flash", {"accelerator": "H100", "capability": "9.0"}),
        ("kernels-community/cuda-flash", {"accelerator": "T4", "capability": "7.5"}),
        ("kernels-community/cuda-flash", {"accelerator": "B200", "capability": "10.0"}),
        ("flash_attention_2", {}),
        ("kernels-community/old-flash", {}),
        ("kernels-community/old-flash", {"cpu": "aarch64"}),
        ("kernels-community/cuda-flash", {"cuda": "12.8"}),
        ("someone/cuda-flash", {}),
        ("someone/cuda-flash", {"allow_all": True}),
        ("flash_attention_4", {}),
        ("kernels-community/nope", {}),
        ("kernels-community/cuda-flash@v2", {}),
        ("sdpa", {}),
    )  # fmt: skip
    system = "uv.lock's torch 2.13 + CUDA 13.0 on x86_64-linux"
    assert cuda == {
        "line": f"attention kernel kernels-community/cuda-flash: version 1, a trusted publisher, build "
        f"torch213-cxx11-cu130-x86_64-linux for {system}; the node's setup fetches and loads it"
    }
    # the build the nodes pick declares the GPUs it runs on (sm_80 and up within 8.x, sm_90): a T4 (7.5) is refused
    assert h100["line"].endswith(
        f"build torch213-cxx11-cu130-x86_64-linux for {system}, which declares the H100's CUDA capability 9.0; the "
        "node's setup fetches and loads it"
    )
    assert t4 == {
        "fatal": "attention kernel kernels-community/cuda-flash at version 1: its build torch213-cxx11-cu130-x86_64-"
        "linux declares CUDA capabilities 8.0, 9.0, and a T4 is 7.5, so every rank's load refuses it; choose an "
        "accelerator it declares, or another attn_implementation, e.g. sdpa"
    }
    assert "fatal" in b200  # 10.0: another generation than 9.0's base build
    # flash_attention_2: no flash-attn package on the nodes, so transformers' fallback repo at the version it asks (3)
    assert fa2 == {
        "fatal": "attention kernel kernels-community/flash-attn2 (attn_implementation flash_attention_2) at version 3 "
        f"has no build for {system}, so no rank could load it (torch-cpu: backend (cpu) does not match system "
        "backend (cuda) and is not universal); choose another attn_implementation, e.g. sdpa"
    }
    assert old["fatal"].startswith(
        f"attention kernel kernels-community/old-flash at version 1 has no build for {system}"
    )
    assert "torch212-cxx11-cu128-x86_64-linux: Torch version (2.12) does not match environment Torch version " \
        "(2.13)" in old["fatal"] and "torch213-cxx11-cu130-aarch64-linux: CPU (aarch64) does not match system CPU " \
        "(x86_64)" in old["fatal"]  # fmt: skip
    assert "build torch213-cxx11-cu130-aarch64-linux " in old_arm["line"]
    assert "fatal" in cuda12  # CUDA 12 nodes cannot load a cu130 build
    assert untrusted == {
        "fatal": "attention kernel someone/cuda-flash is not from a publisher the Hub trusts, and the ranks load only "
        'those; set model_init_kwargs={"allow_all_kernels": true} if you trust its code, or another attn_implementation'
    }
    assert allowed["line"].startswith(
        "attention kernel someone/cuda-flash: version 1, any publisher (allow_all_kernels),"
    )
    # flash_attention_4: transformers asks for version 0 of its kernel (FA4 is in beta); this repo has 1-3 only
    assert fa4 == {
        "fatal": "attention kernel kernels-community/flash-attn4 (attn_implementation flash_attention_4): transformers "
        "asks for version 0, and the repo has 1, 2, 3 only; name a revision "
        "(attn_implementation=kernels-community/flash-attn4@<branch or commit>)"
    }
    assert nope == {
        "fatal": "attention kernel kernels-community/nope does not exist on the Hugging Face Hub, or this machine may "
        "not read it (HF_TOKEN); check attn_implementation in the TRL config, or ORCH_KERNEL_CHECK=off to launch "
        "without this check"
    }
    assert pinned["line"].startswith("attention kernel kernels-community/cuda-flash: revision v2, a trusted publisher")
    assert sdpa == {}
    # the Hub's own failure and a Hub that cannot be reached are notes: the kernel is not at fault
    hub.unavailable = 1
    (busy,) = checked(hub.endpoint, tmp_path / "hf", ("kernels-community/cuda-flash", {}))
    assert busy == {
        "note": "attention kernel kernels-community/cuda-flash: not checked (the Hub failed to answer about its "
        "versions: HTTP 503)"
    }
    (away,) = checked("http://127.0.0.1:9", tmp_path / "hf", ("kernels-community/cuda-flash", {}))
    assert away["note"].startswith(
        "attention kernel kernels-community/cuda-flash: not checked (cannot reach the Hub from here: ConnectError: "
    )


@pytest.mark.e2e  # a dry run, and the check's process imports transformers
def test_orch_run_refuses_a_missing_kernel_before_anything_is_written(hub, project):
    """The launch side runs the check in a process of its own beside the data check, for a cloud launch and its dry
    run: a kernel no rank could load stops it (exit 2, one line, nothing written); a good one is one line."""
    shutil.copy(ROOT / "uv.lock", project / "uv.lock")  # the recipe's workdir: what the nodes install
    env = {"ORCH_KERNEL_CHECK": "on", "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(project / "hf")}  # not ~/.cache
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
    assert f"{said}cxx11-cu130-x86_64-linux for uv.lock's torch 2.13 + CUDA 13.0 on x86_64-linux, which declares the " \
        "L4's CUDA capability 8.9" in done.stdout  # fmt: skip  # the recipe's L4:4
    fp16 = ["bf16=false", "fp16=true", "dtype=float32"]  # a T4 has no bf16 (test_precision_check.py)
    refused = orch(*argv, "--gpus", "T4:4", "attn_implementation=kernels-community/cuda-flash", *fp16, cwd=project,
                   env=env)  # fmt: skip
    assert refused.returncode == 2 and "and a T4 is 7.5, so every rank's load refuses it" in refused.stderr
