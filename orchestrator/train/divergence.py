"""Training whose gradients or loss stop being finite ends at that logging step, saying so, instead of training on.

transformers hides a non-finite loss from its logs (`logging_nan_inf_filter`, on by default, logs the earlier
losses' average instead), and without a loss scaler the optimizer step writes the non-finite gradients into the
weights (clipping multiplies every gradient by max_norm / nan): every later step trains nothing while the logged loss
looks fine. Measured before this module: qwen25_sft_ddp smoke with learning_rate=1e8: grad_norm nan from step 2, the
logged loss 0 from step 3, the summary `loss: step 1 5.8245 -> step 8 0.0000`, exit 0 and a final model of NaN
weights. Under a dynamic loss scaler (fp16: torch's GradScaler, DeepSpeed's fp16) an overflow skips the step and
lowers the scale, so only STOP_AFTER_SCALED such logging steps in a row count.

Every rank judges the same figures (the global grad_norm, the gathered loss, whether any rank's loss was not finite),
so every rank stops at the same step. ORCH_NONFINITE=warn says it and trains on.
"""

from __future__ import annotations

import math

import torch

STOP_AFTER_SCALED = 3


class DivergedError(RuntimeError):
    pass


class Guard:
    """Per trainer: whether any micro-step's loss was not finite since the last log (kept on the loss's device: no
    synchronisation per step), and the logging steps judged."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None
        self.bad_logs = 0
        self.last_finite = 0

    def see(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            bad = ~torch.isfinite(loss.detach()).all()
            self.pending = bad if self.pending is None else self.pending | bad

    def take(self) -> int:
        bad = int(self.pending.item()) if self.pending is not None else 0
        self.pending = None
        return bad

    def judge(self, step: int, logs: dict, any_rank_bad: int, scaled: bool, learning_rate) -> str:
        """At a training log: '' or the line saying what is not finite, what it did, the usual causes."""
        what = []
        grad_norm = logs.get("grad_norm")
        if isinstance(grad_norm, (int, float)) and not math.isfinite(grad_norm):
            what.append(f"grad_norm is {grad_norm}")
        loss = logs.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            what.append(f"the loss is {loss}")
        elif any_rank_bad:
            what.append(f"the loss was not finite (the logged {loss:.6g} is transformers' average of earlier losses: "
                        "logging_nan_inf_filter)")  # fmt: skip
        if not what:
            self.bad_logs, self.last_finite = 0, step
            return ""
        self.bad_logs += 1
        if scaled and self.bad_logs < STOP_AFTER_SCALED:
            return ""  # the loss scaler skipped the step and lowers its scale
        scaler = f" ({self.bad_logs} logging steps in a row: past the loss scaler's skipped steps)" if scaled else ""
        since = f"saved after step {self.last_finite}" if self.last_finite else "of this run"
        return (f"training diverged at step {step}: {'; '.join(what)}{scaler}. The optimizer step writes non-finite "
                "gradients into the weights, so every later step trains nothing. Usual causes: a learning rate too "
                f"high (learning_rate={learning_rate:g}), fp16 overflow (bf16 keeps fp32's range), a bad row in the "
                f"data. Checkpoints {since} may hold non-finite weights: a rerun resumes from the newest one before "
                "(orch marks them when it stops the run)")  # fmt: skip


def scaled(trainer) -> bool:
    """Whether a dynamic loss scaler skips overflowing steps: torch's GradScaler (fp16 AMP) or DeepSpeed's fp16."""
    if getattr(trainer.accelerator, "scaler", None) is not None:
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    enabled = (config.get("fp16") or {}).get("enabled")
    return enabled is True or (enabled == "auto" and bool(trainer.args.fp16))
