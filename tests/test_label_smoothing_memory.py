"""SFT with label_smoothing_factor > 0: TRL 1.16 takes the loss from transformers' LabelSmoother over the model's own
tokens x vocabulary logits, not from its fused head, and the estimate counted the fused head's tile: llama3_sft_fsdp
with label_smoothing_factor=0.1 needs ~33 GiB a GPU, not ~19.5."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core import configs, fit, memory

CASES = [(512, 4096, 256, "cuda"), (1024, 8192, 256, "cuda"), (512, 4096, 256, "fp32"), (512, 4096, 256, "bf16")]


@pytest.mark.e2e
def test_label_smoothing_holds_the_whole_logits_as_the_memory_model_counts():
    cases = [dict(zip(("tokens", "vocab", "hidden", "regime"), c, strict=True)) for c in CASES]
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("label_smoothing_probe.py")), json.dumps(cases)],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    for (tokens, vocab, hidden, regime), measured in zip(CASES, json.loads(run.stdout.splitlines()[-1]), strict=True):
        arch = memory.Arch(1, hidden, hidden, 1, 1, vocab)
        setup = memory.Setup(arch, trainer="sft", full_logits=True, mixed_precision=regime == "cuda",
                             weights_dtype="float32" if regime == "fp32" else "bfloat16")  # fmt: skip
        compute = 4 if regime == "fp32" else 2
        counted = memory.full_logits(memory.with_(setup, arch=memory.Arch(1, 1, 1, 1, 1, vocab)), tokens, compute)
        # the model's peak is the logits' (a 1-wide layer makes the metrics' forward nothing beside them); the
        # hidden states' gradient is left out
        assert measured - tokens * hidden * 8 <= counted <= 1.02 * measured, (regime, measured, counted)
        assert memory.full_logits(setup, tokens, compute) >= counted


@pytest.mark.unit
def test_the_launch_counts_the_whole_logits_for_sfts_label_smoothing_only():
    paired = configs.load({"TRL_CONFIG": "recipes/trl/llama3_sft.yaml",
                           "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_llama.yaml"})  # fmt: skip
    plain = fit.setup_of("sft", paired.trl, paired.accelerate, 16)
    smoothed = fit.setup_of("sft", {**paired.trl, "label_smoothing_factor": "0.1"}, paired.accelerate, 16)
    assert not plain.full_logits and smoothed.full_logits
    before, after = memory.estimate(plain), memory.estimate(smoothed)
    assert "logits" in after.parts and "lm head" not in after.parts and after.gib > before.gib + 12
    tokens = 2 * 4096  # the recipe's 2 x 4096: 16 bytes an entry under bf16 mixed precision
    assert after.parts["logits"] == pytest.approx(tokens * 128256 * 16 / memory.GIB)
    assert fit.tokens_words(smoothed).endswith("(label_smoothing_factor: the loss takes the whole logits, not TRL's "
                                               "fused head)")  # fmt: skip
    for trainer in ("dpo", "kto"):  # their losses are their own: the smoother is never called
        other = fit.setup_of(trainer, {**paired.trl, "label_smoothing_factor": 0.1}, paired.accelerate, 16)
        assert other is not None and not other.full_logits
