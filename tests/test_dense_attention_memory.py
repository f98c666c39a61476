"""The seq x seq tensors attention holds where it is not flash-attention (core/dense_attention.py), against what
transformers' models hold on CPU (tests/dense_attention_probe.py).

The memory model counted every layer's tensors per token ("attention by SDPA/flash keeps no seq x seq matrix"). Under
SDPA, transformers' default, a padded or packed batch takes a boolean mask of rows x seq x seq, which torch turns into a
bias in the compute dtype at every layer and keeps for the backward; eager attention keeps every head's scores. A
DPO run at max_length=16384 on SDPA without gradient checkpointing holds ~114 GiB of them a GPU, and qwen3_sft_fsdp_cp
evaluating 8 x 32768 tokens holds an 8 GiB mask, where the launch check had advised an eval batch that then ran out of
memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core import attention, configs, dense_attention, fit, memory
from orchestrator.core.errors import OrchError

SHAPE = dict(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, batch=2, length=512)
REGIMES = [("Llama", "bfloat16"), ("Qwen2", "float32")]
PHASES = ("trained", "checkpointed", "eval")
KINDS = [("sdpa", "padded"), ("sdpa", "flattened"), ("eager", "padded")]


def _case(family, dtype, phase, attn, shape):
    return dict(SHAPE, family=family, dtype=dtype, phase=phase, attention=attn, shape=shape)


def _setup(family: str, dtype: str, phase: str, attn: str, shape: str) -> memory.Setup:
    s = SHAPE
    arch = memory.Arch(s["layers"], s["hidden"], 2 * s["hidden"], s["heads"], s["kv_heads"], 128,
                       head_dim=s["head_dim"])  # fmt: skip
    return memory.Setup(arch, trainer="sft", micro_batch=s["batch"], eval_batch=s["batch"], seq_len=s["length"],
                        checkpointing=phase == "checkpointed", dense_attention=attn, batch_shape=shape,
                        weights_dtype=dtype, mixed_precision=dtype != "float32")  # fmt: skip


@pytest.fixture(scope="module")
def measured():
    """Each case's peak, less that of the same model on a batch without padding under SDPA (no mask: is_causal), and
    what TRL's collator hands the model padding-free."""
    keys = [(f, d, p, *k) for f, d in REGIMES for p in PHASES for k in [("sdpa", "full"), *KINDS]]
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("dense_attention_probe.py")),
                          json.dumps([_case(*k) for k in keys])], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    peaks_line, collated_line = run.stdout.splitlines()[-2:]
    peaks = dict(zip(keys, json.loads(peaks_line), strict=True))
    return {k: v - peaks[(*k[:3], "sdpa", "full")] for k, v in peaks.items()}, json.loads(collated_line)


@pytest.mark.e2e
@pytest.mark.parametrize("family, dtype", REGIMES)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("attn, shape", KINDS)
def test_attention_holds_the_seq_by_seq_tensors_the_memory_model_counts(measured, family, dtype, phase, attn, shape):
    extra = measured[0][(family, dtype, phase, attn, shape)]
    setup = _setup(family, dtype, phase, attn, shape)
    if phase == "eval":
        counted = memory.eval_forward(setup) - memory.eval_forward(memory.with_(setup, dense_attention=""))
    else:
        counted = dense_attention.training(setup, memory.compute_bytes(setup))
    # within 10% under (the checkpointed backward's order of frees) and 20% over (an evaluation's bias beside the
    # attention's working tensors, which the model takes at their most)
    assert 0.9 * extra <= counted <= 1.2 * extra, (extra, counted)


@pytest.mark.e2e
def test_trls_padding_free_rows_are_one_sequence_whose_positions_restart(measured):
    """What `flattened` stands for: TRL's SFT collator (packing's bfd strategies, padding_free) puts a micro-batch's
    sequences in one row, positions restarting at each, without an attention mask: transformers then builds the
    block-diagonal mask of the whole row under SDPA."""
    assert measured[1] == {"input_ids": [[1, 2, 3, 4, 5]], "position_ids": [[0, 1, 2, 0, 1]], "attention_mask": False}


@pytest.mark.unit
@pytest.mark.parametrize("settings, kind, shape", [
    ({}, "sdpa", "padded"),  # transformers' default attention, TRL's SFT without packing
    ({"attn_implementation": "eager"}, "eager", "padded"),
    ({"attn_implementation": "flash_attention_2", "packing": True}, "", "flattened"),
    ({"attn_implementation": attention.FLASH_KERNEL}, "", "padded"),
    ({"attn_implementation": "sdpa", "model_init_kwargs": '{"attn_implementation": "flex_attention"}'}, "", "padded"),
    ({"packing": "true"}, "sdpa", "flattened"),
    ({"packing": True, "packing_strategy": "wrapped"}, "sdpa", "full"),
    ({"padding_free": True}, "sdpa", "flattened"),
])  # fmt: skip
def test_the_launch_reads_the_attention_and_how_a_batch_reaches_it(settings, kind, shape):
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_sft.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    trl = {k: v for k, v in paired.trl.items() if k not in ("attn_implementation", "packing")}
    setup = fit.setup_of("sft", {**trl, **settings}, paired.accelerate, 8)
    assert (setup.dense_attention, setup.batch_shape) == (kind, shape)
    dpo = fit.setup_of("dpo", {**trl, **settings}, paired.accelerate, 8)
    assert dpo.batch_shape == "padded"  # DPO's padding_free is off in TRL 1.16, and it does not pack
    if kind and shape != "full":
        assert dense_attention.PART[kind] in memory.estimate(setup).parts


@pytest.mark.unit
def test_the_recipes_count_what_their_attention_holds():
    """The SDPA recipes count a mask (a tenth of a GiB at 2048 tokens), the flash-attention ones none."""
    for name, trainer, accelerate in (("phi3_dpo", "dpo", "recipes/accelerate/fsdp2_phi3.yaml"),
                                      ("llama3_sft", "sft", "recipes/accelerate/fsdp2_llama.yaml")):  # fmt: skip
        paired = configs.load({"TRL_CONFIG": f"recipes/trl/{name}.yaml", "ACCELERATE_CONFIG": accelerate})
        parts = memory.estimate(fit.setup_of(trainer, paired.trl, paired.accelerate, 8)).parts
        assert (0 < parts.get("attention mask", 0) < 0.2) == (name == "phi3_dpo"), parts


@pytest.mark.unit
def test_a_refusal_for_seq_by_seq_tensors_names_flash_attention_where_it_can_run():
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_dpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    eager = fit.setup_of("dpo", {**paired.trl, "max_length": 8192, "attn_implementation": "eager"}, paired.accelerate,
                         8)  # fmt: skip
    assert eager.dense_attention == "eager" and memory.estimate(eager).parts["attention scores"] > 60
    with pytest.raises(OrchError) as refused:
        fit.check_gpu(eager, 80, "H100")
    flash = memory.estimate(memory.with_(eager, dense_attention=""))
    assert (f"; attn_implementation={attention.FLASH_KERNEL} (flash-attention holds no seq x seq mask and scores: "
            f"~{flash.gib:.1f} GiB)") in str(refused.value)  # fmt: skip
    fit.check_gpu(memory.with_(eager, dense_attention=""), 80, "H100")  # and flash-attention fits there
    # ring attention runs SDPA alone: its evaluation's refusal offers no flash-attention
    cp = configs.load({"TRL_CONFIG": "recipes/trl/qwen3_sft_long.yaml",
                       "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_cp_qwen3.yaml"})  # fmt: skip
    long = fit.setup_of("sft", {**cp.trl, "packing": False, "eval_strategy": "steps"}, cp.accelerate, 8)
    with pytest.raises(OrchError, match=r"attention mask 8\.0.*set per_device_eval_batch_size=4 \(") as refused:
        fit.check_gpu(long, 40, "A100")
    assert "flash" not in str(refused.value)


@pytest.mark.unit
def test_plan_takes_the_attention_and_the_packing(plan):
    args = ("Qwen/Qwen2.5-1.5B-Instruct", "--trainer", "dpo", "--batch", "4", "--max-length", "8192", "--strategy",
            "zero2", "--gpus", "8")  # fmt: skip
    sdpa, eager, flash = (plan(*args, *extra) for extra in ((), ("--attention", "eager"),
                                                           ("--attention", attention.FLASH_KERNEL)))  # fmt: skip
    assert all(p.returncode == 0 for p in (sdpa, eager, flash)), sdpa.stderr + eager.stderr + flash.stderr
    assert "attention sdpa" in sdpa.stdout.splitlines()[0] and "attention mask" in sdpa.stdout
    assert "attention scores" in eager.stdout and "attention" not in flash.stdout.split("\n", 1)[1]
    refused = plan("Qwen/Qwen2.5-1.5B-Instruct", "--trainer", "dpo", "--packing", "bfd")
    assert refused.returncode == 2 and "--packing: dpo does not pack" in refused.stderr
    typo = plan("Qwen/Qwen2.5-1.5B-Instruct", "--attention", "spda")  # planned as flash-attention, it said nothing
    assert typo.returncode == 2 and "--attention spda: give one of sdpa, eager, flash_attention_2" in typo.stderr
