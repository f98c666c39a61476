"""What a step costs and how fast the run goes, in the training process: tokens per second over all ranks (counted
from the micro-batches each rank trained on, padding excluded), model FLOPs utilisation against the accelerator's
peak, elapsed time, ETA, and dollars when the run's price is known (ORCH_PRICE_PER_HOUR, the cluster's $/h).

Tokens: the attention mask's ones (GRPO: prompt and completion masks); a padding-free batch (packing) has no padding
to exclude, so its length counts. MFU: 6 x parameters per token (forward and backward of a dense model, attention
excluded), plus 2 x parameters for a DPO/KTO reference model's forward, over the peak dense bf16 throughput of the
accelerator (core/accelerators.PEAK_BF16_TFLOPS, from the vendors' datasheets) x the number of ranks.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping

import torch

from orchestrator.core.accelerators import peak_tflops
from orchestrator.core.knobs import knob
from orchestrator.core.timeline import duration


def tokens_in(inputs) -> tuple[int, bool]:
    """(tokens in one micro-batch, whether padding was excluded)."""
    get = inputs.get if hasattr(inputs, "get") else (lambda _key: None)
    masks = [get(k) for k in ("attention_mask", "prompt_mask", "completion_mask")]
    masks = [m for m in masks if m is not None and hasattr(m, "sum")]
    if masks:
        return int(sum(int(m.sum()) for m in masks)), True
    for key in ("input_ids", "prompt_ids", "completion_ids"):
        value = get(key)
        if value is not None and hasattr(value, "numel"):
            # padding-free batches (packing) hold no padding: their length is the tokens
            return int(value.numel()), get("position_ids") is not None or int(value.shape[0]) == 1
    return 0, False


class Meter:
    def __init__(self, env: Mapping[str, str] = os.environ, started: float | None = None):
        self.price = knob(env, "ORCH_PRICE_PER_HOUR")  # $/h of the cluster (core/knobs.py)
        self.run_started = started or time.time()  # the run's start (launch), for elapsed time and dollars
        self.train_started = 0.0
        self.step_times: list[float] = []
        self.last = (0.0, 0)  # (time, total tokens) at the previous log
        self.flops_per_token = 0.0
        self.peak = None  # TFLOPS per device, None when unknown (CPU, an accelerator without a sourced figure)
        self.peak_note = ""
        self.padding_excluded = True
        self.latest: dict = {}
        self.earlier_usd, self.attempts = 0.0, 1  # the run's earlier attempts (train/spend.py)

    def begin(self, model, ref_model, device: torch.device) -> None:
        params = sum(getattr(p, "ds_numel", 0) or p.numel() for p in model.parameters())
        ref = sum(getattr(p, "ds_numel", 0) or p.numel() for p in ref_model.parameters()) if ref_model else 0
        self.flops_per_token = 6.0 * params + 2.0 * ref
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self.peak = peak_tflops(name)
            self.peak_note = "" if self.peak else f"no sourced peak figure for {name}"
        else:
            self.peak_note = f"not shown on {device.type.upper()} (no peak bf16 figure for a CPU)"
        self.train_started = time.time()
        self.last = (self.train_started, 0)

    def stepped(self) -> None:
        self.step_times = (self.step_times + [time.time()])[-50:]

    def sample(self, total: torch.Tensor, step: int, max_steps: int, world: int, dist) -> dict:
        """Every rank calls it at a logging step with its token count (a 1-element tensor where the group's
        collectives take it: one all-reduce); returns the figures (rank 0 prints them)."""
        if dist is not None:
            dist.all_reduce(total)
        now, tokens = time.time(), int(total.item())
        window = max(1e-9, now - self.last[0])
        figures = {
            "tokens": tokens,
            "tokens_per_s": (tokens - self.last[1]) / window,
            "tokens_per_s_run": tokens / max(1e-9, now - self.train_started),
            "elapsed_s": now - self.run_started,
        }
        self.last = (now, tokens)
        if self.peak and self.flops_per_token:
            figures["mfu"] = figures["tokens_per_s"] * self.flops_per_token / (self.peak * 1e12 * world)
            figures["mfu_run"] = figures["tokens_per_s_run"] * self.flops_per_token / (self.peak * 1e12 * world)
        if len(self.step_times) >= 2:
            intervals = [b - a for a, b in zip(self.step_times, self.step_times[1:], strict=False)]
            figures["eta_s"] = max(0, max_steps - step) * statistics.median(intervals)
        if self.price is not None:
            figures["spent_usd"] = self.spent(figures["elapsed_s"])
            if "eta_s" in figures:
                figures["projected_usd"] = figures["spent_usd"] + self.price * figures["eta_s"] / 3600
        if self.attempts > 1:
            figures["attempts"] = self.attempts
        self.latest = figures
        return figures

    def spent(self, elapsed: float) -> float:
        """Dollars over every attempt of the run: the earlier ones' record and this one's time at its price."""
        return self.earlier_usd + (self.price or 0.0) * elapsed / 3600

    def describe(self, figures: Mapping) -> str:
        parts = [f"{figures['tokens_per_s']:,.0f} tok/s" + ("" if self.padding_excluded else " (padding included)")]
        if "mfu" in figures:
            parts.append(f"MFU {100 * figures['mfu']:.1f}%")
        parts.append(f"elapsed {duration(figures['elapsed_s'])}")
        if "eta_s" in figures:
            parts.append(f"ETA {duration(figures['eta_s'])}")
        if "spent_usd" in figures:
            parts.append(
                f"${figures['spent_usd']:,.2f} spent"
                + (f" over {figures['attempts']} attempts" if figures.get("attempts", 1) > 1 else "")
                + (f", ${figures['projected_usd']:,.2f} at the end" if "projected_usd" in figures else "")
            )
        return " | ".join(parts)
