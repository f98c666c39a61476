"""Memory while GRPO or RLOO generate without vLLM, or gather the model to sync vLLM's weights, beside the training
states (core/generation_memory.py), against transformers' generate and TRL's GRPOConfig on CPU.

The launch check counted the training step alone. Without vLLM a rank generates its whole generation batch at once
(per_device_train_batch_size x steps_per_generation, the accumulation by default) with a cache of every token's k and
v; under ZeRO-3 TRL first gathers the whole model on every GPU (ds3_gather_for_generation) and, with LoRA and vLLM,
to merge the adapter before each weight sync: Llama-3.1-70B GRPO under ZeRO-3 trains in ~42 GiB of an H100 and
needed ~183 to generate."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core import configs, fit, generation_memory, memory
from orchestrator.core.errors import OrchError

SHAPE = dict(family="Qwen2", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16")
CASES = [(8, 64, 64), (8, 64, 192), (16, 64, 64), (8, 192, 64)]  # rows, prompt tokens, completion tokens


# GRPO and RLOO settings at a world size (trainer, processes, GLOBAL_BATCH_SIZE or None, TRL settings): each with every
# smaller per-device batch a memory refusal would offer (core/batch.smaller), for TRL's own config to take
SETTINGS = [
    ("grpo", 8, 256, {"per_device_train_batch_size": 8, "num_generations": 8}),
    ("grpo", 8, None, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "num_generations": 8}),
    ("grpo", 4, None, {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2, "num_generations": 4,
                       "steps_per_generation": 2}),
    # 3 divides a rank's 12 samples a step, but TRL wants the generation batch (16) a multiple of it x 4 processes
    ("grpo", 4, None, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "num_generations": 4,
                       "generation_batch_size": 16}),
    ("grpo", 4, None, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "num_generations": 4,
                       "generation_batch_size": 32}),
    # 2 completions at a time on each of 2 processes would split a group of 8
    ("grpo", 2, None, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "num_generations": 8}),
    ("rloo", 4, 64, {"per_device_train_batch_size": 4}),
    ("rloo", 2, None, {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 3, "steps_per_generation": 3}),
]  # fmt: skip


def variants(trainer: str, world: int, global_batch: int | None, settings: dict) -> list[tuple[str, dict, int]]:
    """(what, the settings TRL sees, the completions a rank then generates at once by orch's reading): the settings as
    given, each smaller batch a memory refusal offers (core/batch.smaller), and each smaller generation batch a
    generation refusal offers (generation_memory.fewer); the accumulation GLOBAL_BATCH_SIZE derives, as the node
    passes it."""
    from orchestrator.core import batch, trainers

    def seen(trl: dict) -> dict:
        derived = global_batch // (trl["per_device_train_batch_size"] * world) if global_batch else None
        return {**trl, **({"gradient_accumulation_steps": derived} if derived else {})}

    spec = trainers.spec(trainer)
    smaller = batch.smaller(settings, global_batch, world, None, spec)
    fewer = generation_memory.fewer(settings, world, global_batch, spec.generations_default)
    assert smaller, (trainer, settings)
    rows = generation_memory.rows_of(settings, world, global_batch)
    def applied(fix) -> dict:
        return seen({**settings, **{key: int(value) for key, value in fix.overrides}})

    return ([("given", seen(settings), rows)] + [("smaller", applied(s), rows) for s in smaller]
            + [("fewer", applied(f), f.batch) for f in fewer])  # fmt: skip


TRL_CASES = [dict(trainer=t, world=w, settings=s) for t, w, g, base in SETTINGS for _, s, _ in variants(t, w, g, base)]


@pytest.fixture(scope="module")
def measured():
    cases = [dict(SHAPE, rows=r, prompt=p, completion=c) for r, p, c in CASES]
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("generation_probe.py")), json.dumps(cases),
                          json.dumps(TRL_CASES)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    peaks, config, trl = run.stdout.splitlines()[-3:]
    return dict(zip(CASES, json.loads(peaks), strict=True)), json.loads(config), json.loads(trl)


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_generate_holds_what_the_memory_model_counts(measured, case):
    """The prompt's forward with its cache so far and SDPA's mask of the left-padded prompts, or the whole cache at
    the end with one layer's k and v repeated to the query heads: within 10% under and 20% over."""
    rows, prompt, completion = case
    arch = memory.Arch(4, 64, 128, 4, 2, 256, head_dim=16)
    setup = memory.Setup(arch, trainer="grpo", seq_len=prompt + completion, completion_len=completion,
                         generation_rows=rows, dense_attention="sdpa")  # fmt: skip
    peak, counted = measured[0][case], generation_memory.forward(setup)
    assert 0.9 * peak <= counted <= 1.2 * peak, (peak, counted)


@pytest.mark.e2e
def test_trl_generates_the_accumulation_s_completions_at_once(measured):
    """TRL's GRPOConfig: steps_per_generation defaults to gradient_accumulation_steps, the generation batch is the
    per-device batch times it (on one process), and ZeRO-3 gathers the model for generate unless told otherwise."""
    assert measured[1] == {"steps_per_generation": 4, "generation_batch_size": 8, "ds3_gather_for_generation": True}
    settings = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    assert generation_memory.rows_of(settings, 1, None) == 8
    assert generation_memory.rows_of(settings, 8, 256) == 2 * 16  # GLOBAL_BATCH_SIZE's accumulation, as the node's
    assert generation_memory.rows_of({**settings, "steps_per_generation": 2}, 8, 256) == 4
    assert generation_memory.rows_of({**settings, "generation_batch_size": 64}, 8, 256) == 8


@pytest.mark.e2e
def test_trl_takes_every_batch_a_refusal_offers_and_generates_what_orch_counts(measured):
    """TRL's own config, at the run's world size, accepts each fix a memory refusal offers GRPO and RLOO (whole
    num_generations groups, a generation_batch_size that is a multiple of the per-device batch x processes): a smaller
    per-device batch (core/batch.smaller) keeps the generation batch; a smaller generation batch
    (generation_memory.fewer) generates the completions orch counts, a whole number of times an optimizer step."""
    made = iter(measured[2])
    for trainer, world, global_batch, settings in SETTINGS:
        before = None
        for what, trl, rows in variants(trainer, world, global_batch, settings):
            derived = next(made)
            assert isinstance(derived, list), (trainer, what, trl, derived)
            generation_batch, steps = derived
            assert generation_batch == rows * world, (trainer, what, trl, derived)
            before = before or generation_batch
            if what == "smaller":
                assert generation_batch == before, (trainer, trl, derived)
            if what == "fewer":
                assert generation_batch < before and trl["gradient_accumulation_steps"] % steps == 0, (trl, derived)
    assert next(made, None) is None


def _grpo(**trl) -> memory.Setup:
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml",
                           "ACCELERATE_CONFIG": "recipes/accelerate/zero3_offload.yaml"})  # fmt: skip
    setup = fit.setup_of("grpo", {**paired.trl, "model_name_or_path": "meta-llama/Llama-3.1-70B-Instruct", **trl},
                         paired.accelerate, 8, global_batch=256)  # fmt: skip
    assert setup is not None
    return setup


@pytest.mark.unit
def test_zero3_generating_the_whole_model_on_every_gpu_is_refused_with_the_setting_that_fits():
    setup = _grpo(use_vllm=False, per_device_train_batch_size=2)
    assert setup.generation_rows == 32 and generation_memory.gathers_all(setup)
    during = generation_memory.estimate(setup)
    assert memory.estimate(setup).gib <= 80 * fit.USABLE_FRACTION < during.gib
    assert during.parts["gathered"] == pytest.approx(setup.arch.params * 2 / memory.GIB)  # bf16, on every GPU
    with pytest.raises(OrchError) as refused:
        fit.check_gpu(setup, 80, "H100")
    said = str(refused.value)
    assert said.startswith("generating 32 completions at once (transformers' generate, use_vllm false: ")
    assert "though training fits; ds3_gather_for_generation=false (~" in said
    fit.check_gpu(_grpo(use_vllm=False, per_device_train_batch_size=2, ds3_gather_for_generation=False), 80, "H100")


@pytest.mark.unit
def test_a_generation_batch_that_does_not_fit_is_refused_with_fewer_completions_at_a_time():
    """Without ZeRO-3's gather to turn off, the refusal names the largest smaller generation batch that fits
    (generation_memory.fewer: steps_per_generation at a divisor of the accumulation, whole groups), and it fits."""
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    trl = {**paired.trl, "use_vllm": False, "per_device_train_batch_size": 2, "max_completion_length": 30000}
    setup = fit.setup_of("grpo", trl, paired.accelerate, 8, global_batch=256)
    assert setup.generation_rows == 32 and memory.estimate(setup).gib <= 40 * fit.USABLE_FRACTION
    with pytest.raises(OrchError) as refused:
        fit.check_gpu(setup, 40, "A100")
    fixed = fit.setup_of("grpo", {**trl, "steps_per_generation": 8}, paired.accelerate, 8, global_batch=256)
    during = generation_memory.estimate(fixed)
    assert str(refused.value).endswith(f"though training fits; set steps_per_generation=8 (~{during.gib:.1f} GiB: 16 "
                                       "completions at a time, 2 generations an optimizer step)")  # fmt: skip
    assert fixed.generation_rows == 16 and fit.check_gpu(fixed, 40, "A100")
    # given as generation_batch_size, the fix is one: 16 completions x 8 processes
    gbs = fit.setup_of("grpo", {**trl, "generation_batch_size": 256}, paired.accelerate, 8, global_batch=256)
    assert [f.words() for f in gbs.generation_fewer] == ["generation_batch_size=128", "generation_batch_size=64",
                                                          "generation_batch_size=32", "generation_batch_size=16"]


@pytest.mark.unit
def test_orch_plan_holds_the_generation_in_every_row(plan):
    """`orch plan --generate N`: each row's GPU holds N completions generated at once beside the training states, as
    the launch check counts them (an A100-40GB trains 2 x 20512 tokens of Qwen2.5-1.5B GRPO, not 64 such
    completions); one configuration's breakdown says what generating holds, ZeRO-3's whole-model gather included."""
    base = ("Qwen/Qwen2.5-1.5B-Instruct", "--trainer", "grpo", "--max-completion-length", "20000", "--batch", "2")
    rows = {line.split()[0]: line for line in plan(*base).stdout.splitlines()[1:]}
    held = plan(*base, "--generate", "64")
    assert held.returncode == 0, held.stderr
    assert held.stdout.splitlines()[0].endswith(", generating 64 completions at once without vLLM")
    generating = {line.split()[0]: line for line in held.stdout.splitlines()[1:]}
    root = Path(__file__).parent.parent  # the plan runs in a folder of its own
    paired = configs.load({"TRL_CONFIG": str(root / "recipes/trl/qwen25_grpo.yaml"), "ACCELERATE_CONFIG": "multi_gpu"})
    setup = fit.setup_of("grpo", {**paired.trl, "use_vllm": False, "per_device_train_batch_size": 2,
                                  "max_completion_length": 20000, "steps_per_generation": 32}, paired.accelerate, 8)
    assert setup.generation_rows == 64
    assert re.match(r"A100 +1 x 8 +DDP ", rows["A100"]) and re.match(r"A100 +- +none", generating["A100"])
    assert re.match(rf"H100 +1 x 8 +DDP +{generation_memory.estimate(setup).gib:.1f} ", generating["H100"])
    one = plan(*base, "--generate", "64", "--strategy", "zero3", "--gpus", "8").stdout
    assert re.search(r"^generating: ~[\d.]+ GiB per GPU \(.*generation [\d.]+, gathered 2\.9", one, re.M), one


@pytest.mark.unit
def test_what_gathers_the_model_and_what_generates():
    assert _grpo(use_vllm=False).generation_gather  # TRL's default ds3_gather_for_generation
    assert not _grpo(use_vllm=False, ds3_gather_for_generation="false").generation_gather
    vllm = _grpo(use_vllm=True, vllm_mode="server")
    assert vllm.generation_rows == 0 and generation_memory.estimate(vllm) is None  # vLLM generates, no gather
    lora = _grpo(use_vllm=True, vllm_mode="server", use_peft=True)  # TRL merges the adapter gathered
    assert lora.generation_rows == 0 and generation_memory.gathers_all(lora)
    assert generation_memory.words(lora).startswith("syncing vLLM's weights")
    assert generation_memory.estimate(lora).parts["generation"] == 0
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    ddp = fit.setup_of("grpo", {**paired.trl, "use_vllm": False}, paired.accelerate, 8, global_batch=256)
    assert ddp.generation_rows == 32 and not generation_memory.gathers_all(ddp)  # DDP generates as it trains
    assert generation_memory.estimate(ddp).parts["generation"] > 0
    # QLoRA under ZeRO-3: the gather brings the base's 4-bit storage (NF4 and its scales, DeepSpeed partitions the
    # packed bitsandbytes tensors), not bf16 weights: Llama-3.1-70B ~39.8 GiB, not ~131
    qlora = _grpo(use_vllm=False, use_peft=True, load_in_4bit=True)
    gathered = generation_memory.estimate(qlora).parts["gathered"]
    assert qlora.method == "qlora" and gathered == pytest.approx(memory.loaded_bytes(qlora) / memory.GIB)
    assert 0.28 < gathered / generation_memory.estimate(_grpo(use_vllm=False)).parts["gathered"] < 0.32


@pytest.mark.cli
def test_the_dry_run_shows_the_generation_and_the_launch_refuses_what_does_not_fit(project):
    from conftest import orch

    env = {"ORCH_DATA_CHECK": "off", "ORCH_REHEARSAL": "off", "HF_TOKEN": "x"}
    base = ["run", "qwen25_grpo_ddp", "--secret", "HF_TOKEN", "--dry-run", "--skip-optimizer", "use_vllm=false"]
    shown = orch(*base, env=env, cwd=project)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "memory while generating 32 completions at once (transformers' generate, use_vllm false: " in shown.stdout
    big = ["--env", "ACCELERATE_CONFIG=recipes/accelerate/zero3_offload.yaml", "--gpus", "H100:8",
           "model_name_or_path=meta-llama/Llama-3.1-70B-Instruct", "per_device_train_batch_size=2"]  # fmt: skip
    refused = orch(*base, *big, env=env, cwd=project)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "orch: error: generating 32 completions at once"), refused.stderr  # fmt: skip
