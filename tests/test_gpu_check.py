"""`make gpu-check` (bench/gpu_check.py): its arithmetic here, itself only where a CUDA GPU is."""

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
        assert kind == {"FSDP2": "fsdp2", "ZeRO-3": "zero3", "ZeRO-2": "zero2", "ZeRO-1": "zero1", "DDP": "ddp"}[label]


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
