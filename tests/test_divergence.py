"""Training whose gradients or loss stop being finite ends there, saying so (train/divergence.py): the rule, the loss
scaler's exception read from accelerate's own objects, and a 2-node run with a learning rate that blows up."""

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import orch

from orchestrator.train.divergence import STOP_AFTER_SCALED, Guard, scaled

pytestmark = pytest.mark.unit

NAN, INF = float("nan"), float("inf")


def test_without_a_loss_scaler_the_first_non_finite_logging_step_stops():
    guard = Guard()
    assert guard.judge(1, {"loss": 5.8, "grad_norm": 4.1}, 0, False, 2e-3) == ""
    line = guard.judge(2, {"loss": 5.8, "grad_norm": NAN}, 0, False, 2e-3)
    assert line.startswith("training diverged at step 2: grad_norm is nan. The optimizer step writes non-finite ")
    assert "(learning_rate=0.002)" in line and line.endswith("Checkpoints saved after step 1 may hold non-finite "
                                                            "weights: a rerun resumes from the newest one before (orch "
                                                            "marks them when it stops the run)")  # fmt: skip
    # the loss transformers logs is the earlier losses' average when one was not finite (logging_nan_inf_filter)
    line = Guard().judge(4, {"loss": 2.5, "grad_norm": 1.0}, 1, False, 1e-5)
    assert "the loss was not finite (the logged 2.5 is transformers' average of earlier losses" in line
    assert "Checkpoints of this run may hold" in line
    assert "the loss is inf" in Guard().judge(3, {"loss": INF}, 1, False, 1e-5)  # no grad_norm (max_grad_norm 0)


def test_under_a_loss_scaler_only_logging_steps_in_a_row_count():
    guard = Guard()
    for step in range(1, STOP_AFTER_SCALED):  # overflows the scaler skips: nothing said
        assert guard.judge(step, {"loss": 3.0, "grad_norm": INF}, 0, True, 1e-5) == ""
    assert guard.judge(STOP_AFTER_SCALED, {"loss": 3.0, "grad_norm": 1.0}, 0, True, 1e-5) == ""  # back in range
    for step in range(STOP_AFTER_SCALED + 1, 2 * STOP_AFTER_SCALED):
        assert guard.judge(step, {"loss": 3.0, "grad_norm": INF}, 0, True, 1e-5) == ""
    line = guard.judge(2 * STOP_AFTER_SCALED, {"loss": 3.0, "grad_norm": INF}, 0, True, 1e-5)
    assert f"grad_norm is inf ({STOP_AFTER_SCALED} logging steps in a row: past the loss scaler's" in line
    assert f"after step {STOP_AFTER_SCALED} may hold" in line


def test_checkpoints_saved_after_the_last_finite_step_are_marked_and_no_resume_starts_from_them(tmp_path):
    from orchestrator.train import checkpoints

    for step in (2, 4, 6):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(b"weights")
        checkpoints.write_manifest(ckpt, node=0, nodes=1, step=step)  # complete: verify() passes it
    verdict = "training diverged at step 5: grad_norm is nan. The optimizer step writes non-finite gradients"
    assert checkpoints.mark_diverged(tmp_path, 2, verdict) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoints.verify(tmp_path / "checkpoint-6") == "saved after training diverged at step 5: grad_norm is nan"
    assert checkpoints.verify(tmp_path / "checkpoint-2") == ""  # saved before: resumed from
    chosen, skipped = checkpoints.choose_resume(tmp_path, 0, lambda x: x)
    assert chosen == tmp_path / "checkpoint-2" and [p.name for p, _ in skipped] == ["checkpoint-4", "checkpoint-6"]


def test_a_rank_keeps_whether_any_micro_step_s_loss_was_not_finite_until_the_log():
    guard = Guard()
    assert guard.take() == 0
    for loss in (torch.tensor(1.0), torch.tensor(NAN), torch.tensor(2.0)):
        guard.see(loss)
    assert guard.take() == 1 and guard.take() == 0  # taken at each log
    guard.see(torch.tensor([1.0, INF]))
    assert guard.take() == 1


def test_the_loss_scaler_is_read_where_accelerate_keeps_it():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    accelerator = Accelerator(cpu=True)
    assert accelerator.scaler is None and hasattr(accelerator.state, "deepspeed_plugin")  # the names read
    plain = SimpleNamespace(accelerator=accelerator, args=SimpleNamespace(fp16=False))
    assert not scaled(plain)
    amp = SimpleNamespace(accelerator=SimpleNamespace(scaler=object(), state=None), args=plain.args)
    assert scaled(amp)

    def deepspeed(enabled, fp16):  # accelerate's own plugin, from a DeepSpeed config as a recipe gives it
        plugin = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": enabled}, "zero_optimization": {"stage": 2},
                                               "train_micro_batch_size_per_gpu": 1})  # fmt: skip
        state = SimpleNamespace(deepspeed_plugin=plugin)
        return SimpleNamespace(accelerator=SimpleNamespace(scaler=None, state=state), args=SimpleNamespace(fp16=fp16))

    assert scaled(deepspeed(True, False)) and scaled(deepspeed("auto", True))
    assert not scaled(deepspeed("auto", False)) and not scaled(deepspeed(False, True))


@pytest.mark.e2e
def test_a_run_whose_gradients_blow_up_stops_at_that_step_on_every_rank(project):
    """learning_rate=1e8: step 2's gradients are nan. Before, the run trained on with NaN weights, logged a loss of 0
    from step 3 (transformers' filter), said `loss: step 1 5.8245 -> step 8 0.0000`, exited 0 and wrote a final model
    of NaN weights. Now both nodes stop at step 2 and the run fails naming it; ORCH_NONFINITE=warn trains on, saying
    so. Logged every 3 steps and saved every 2, the divergence is found at step 3, after checkpoint-2 was saved with
    NaN weights: that checkpoint is marked, and no resume starts from it."""
    done = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "learning_rate=1e8", "logging_steps=3",
                "save_steps=2", cwd=project, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    final = done.stdout.strip().splitlines()[-1]
    assert re.search(r"^\[orch\] failed after [\d.]+ s: node \d exited with code 1: orchestrator\.train\.divergence\."
                     r"DivergedError: training diverged at step 3: grad_norm is nan[.;] ", final), final  # fmt: skip
    assert "[orch] step 3/8" in done.stdout and "[orch] step 4/" not in done.stdout
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", done.stdout, re.M).group(1)
    assert not (output_dir / "model.safetensors").exists()  # no final model of NaN weights
    from safetensors.torch import load_file

    from orchestrator.train import checkpoints

    saved = load_file(output_dir / "checkpoint-2" / "model.safetensors")
    assert any(not torch.isfinite(t).all() for t in saved.values())  # what the mark keeps a resume from
    marked = checkpoints.verify(output_dir / "checkpoint-2")
    assert marked.startswith("saved after training diverged at step 3: grad_norm is nan"), marked
    warned = orch("run", "qwen25_sft_ddp", "--local", "--nodes", "1", "--gpus", "CPU:1", "--smoke", "--fresh", "-y",
                  "learning_rate=1e8", "max_steps=3", "--env", "ORCH_NONFINITE=warn", cwd=project,
                  timeout=300)  # fmt: skip
    assert warned.returncode == 0, warned.stdout[-3000:]
    said = re.findall(r"\[orch\] warning: training diverged at step (\d): .* \(ORCH_NONFINITE=warn: training goes on\)",
                      warned.stdout)  # fmt: skip
    assert said == ["2", "3"], warned.stdout[-3000:]
