"""`make gpu-check` (bench/gpu_check.py): its arithmetic here, itself only where a CUDA GPU is."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.cli

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_flops_and_mfu_arithmetic():
    # 0.5B params, 24 layers, hidden 896, seq 2048: 6N + 12 L H S
    per_token = gpu_check.flops_per_token(500_000_000, 24, 896, 2048)
    assert per_token == 6 * 5e8 + 12 * 24 * 896 * 2048
    # 100k tokens/s on one 989 TFLOP/s GPU
    assert gpu_check.mfu(100_000, per_token, 1, 989.0) == pytest.approx(100_000 * per_token / 989e12)
    assert gpu_check.peak_for("NVIDIA H100 80GB HBM3") == 989.0 and gpu_check.peak_for("Tesla T4") is None


def test_every_strategy_label_names_a_shipped_recipe_of_that_strategy():
    from orchestrator.core import strategy
    from orchestrator.launch import recipe

    for label, name in gpu_check.STRATEGIES.items():
        launch_recipe = recipe.load(name)
        from orchestrator.core import configs

        accel, _ = configs.load_accelerate(launch_recipe.envs["ACCELERATE_CONFIG"], ROOT)
        kind = strategy.of(accel).kind
        assert kind == {"FSDP2": "fsdp2", "ZeRO-3": "zero3", "ZeRO-2": "zero2", "ZeRO-1": "zero1", "DDP": "ddp",
                        "QLoRA": "fsdp2"}[label]  # fmt: skip


def test_a_hub_kernel_not_in_the_cache_falls_back_to_sdpa_and_says_so(monkeypatch, tmp_path):
    """gpu-check runs offline: a recipe's Kernels Hub attention is kept only where a rank could load it from the cache.
    Its first GPU run asked the ranks for kernels-community/flash-attn2 because the kernels package was installed,
    and every rank failed on the download."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    attn, why = gpu_check._attention("kernels-community/flash-attn2")
    assert attn == "sdpa" and why.startswith("kernels-community/flash-attn2 asked, "), why
    assert gpu_check._attention("sdpa") == ("sdpa", "")


@pytest.mark.e2e  # builds two tiny smoke models with transformers (~6.5 s)
def test_load_figures_read_the_gpu_peak_and_the_model_for_the_smoke_model(monkeypatch):
    """The GPU-at-load part of each strategy line, from a report shaped like a GPU rank's (train/loading.py writes
    `gpu_peak` per phase where CUDA is in use) and the memory model for the recipe on the smoke model's shape."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as gpu-check runs (its main): no kernel download
    from orchestrator.core import smoke
    from orchestrator.launch import recipe, resolved

    def overrides(name: str) -> dict:
        launch = resolved.resolve(recipe.load(name))
        artifacts = smoke.plan(str(launch.setting("model_name_or_path", "")), launch.trainer)
        smoke.ensure(artifacts)
        return gpu_check._gpu_overrides(launch, artifacts)[0]

    report = {"host_memory": {"load": {"peak": 1, "after": 1, "gpu_peak": 3 * 2**20},
                              "prepare": {"peak": 1, "after": 1, "gpu_peak": 5 * 2**20}}}  # fmt: skip
    line = gpu_check.load_figures("llama3_70b_qlora_fsdp", overrides("llama3_70b_qlora_fsdp"), 1, report)
    assert re.fullmatch(r"GPU at load 5\.0 MiB \(load 3\.0, prepare 5\.0\) \(model [\d.]+ MiB: 4-bit\)", line), line
    # a resumed start's prepare also loads the checkpoint's states (16.0 bytes a parameter for ZeRO-3 on the H100, not
    # initialize's 8): said apart, never compared with the fresh start's figure
    assert gpu_check.resume_peak(report) == "resumed start's GPU peak 5.0 MiB"
    cpu = {"host_memory": {"load": {"peak": 1, "after": 1}}}
    line = gpu_check.load_figures("llama3_sft_zero3", overrides("llama3_sft_zero3"), 1, cpu)
    assert re.fullmatch(r"GPU at load not measured \(model [\d.]+ MiB: ZeRO-3 with deepspeed\.zero\.Init\)", line), line


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU: the refusal cannot be shown")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gpu-check: error: no CUDA GPU on this machine")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (make gpu-check runs it where one is)")
def test_gpu_check_runs_every_strategy():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *gpu_check.STRATEGIES], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for label in gpu_check.STRATEGIES:
        line = next(x for x in lines if x.startswith(label))
        assert "FAILED" not in line and "final model loads" in line and "resumed from checkpoint-8" in line, line


def test_a_fused_head_case_leaves_nothing_behind_for_the_next(monkeypatch):
    """The frozen head's figure is measured after the trained one's: anything the trained case keeps alive (its first
    GPU run kept the autograd graph of an unused output, and through it the weight and its gradient) is freed during
    the next case and hides that case's peak. Each case, run here on CPU, must free every tensor it made."""
    import gc
    import weakref

    import torch
    from trl.kernels import chunked_logprob

    made = []
    apply = chunked_logprob.ChunkedLogProbFunction.apply

    def watched(*args):
        outputs = apply(*args)
        made.extend(weakref.ref(t) for t in (*args[:2], *(o for o in outputs if o is not None)))
        return outputs

    monkeypatch.setattr(chunked_logprob.ChunkedLogProbFunction, "apply", watched)
    for trained in (True, False):
        assert gpu_check.head_peak(torch, trained, vocab=512, hidden=32, tokens=64, device="cpu") == 0
        gc.collect()
        assert made and all(ref() is None for ref in made), [ref() is None for ref in made]
        made.clear()


def test_the_flash_stand_in_self_test_passes_the_stand_in_and_catches_a_kernel_that_mixes_documents():
    """flash_standin serves the recipes' flash-attn2 only after this self-test: here on CPU, where the stand-in
    computes with SDPA's math (its CUDA path, PyTorch's FlashAttention, runs under make gpu-check)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import torch_flash

    assert gpu_check._standin_selftest(torch, torch_flash, device="cpu") < 2e-2

    class Mixing:  # causal over the whole packed row: the second document attends to the first
        flash_attn_func = staticmethod(torch_flash.flash_attn_func)

        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
            return torch_flash.flash_attn_func(q[None], k[None], v[None], causal=causal)[0]

    assert gpu_check._standin_selftest(torch, Mixing, device="cpu") > 0.1


def test_the_stand_in_is_used_only_where_the_recipes_kernel_does_not_load(monkeypatch):
    import torch

    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.setattr(gpu_check, "_attention", lambda asked: (asked, ""))
    assert "no stand-in" in gpu_check.flash_standin(torch)
    assert "LOCAL_KERNELS" not in __import__("os").environ
    monkeypatch.setenv("LOCAL_KERNELS", "kernels-community/flash-attn2=/somewhere")
    assert "used as given" in gpu_check.flash_standin(torch)
    assert not gpu_check.standing_in()
