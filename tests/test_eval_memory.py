"""Memory while the trainer evaluates (eval_strategy), against what transformers and TRL do on CPU.

transformers evaluates per_device_eval_batch_size sequences at a time (8 unless the config says), whatever the
training batch: a run that trains at 1 x 32768 tokens evaluates 8 x 32768 at once, without gradients but with every
token's working tensors in each layer. The launch check counted the training step alone, so such a run met its OOM at
the first evaluation, after its steps were paid for. core/eval_memory.py counts it, core/fit.check_evaluation
refuses it naming the eval batch that fits."""

import itertools
import re

import pytest

from orchestrator.core import configs, eval_memory, fit, generation_memory, memory, models
from orchestrator.core.errors import OrchError

# one worker: the module's measurements are made once, beside the trainer's run (transformers and TRL imported once)
ONE_WORKER = pytest.mark.xdist_group("eval_memory")
TILE = (128, 512)  # TRL's fused-head tile, scaled down as in tests/test_lm_head_memory.py

SHAPES = [  # hidden, intermediate, heads, KV heads, head_dim
    (256, 896, 8, 2, 32),  # the MLP's intermediate tensors make the peak (every real model's case)
    (512, 1024, 8, 2, 64),
    (256, 64, 8, 2, 128),  # a narrow MLP: the attention's q, k, v and their rotated copies make it
    (256, 64, 16, 2, 128),
]
# fp32 (the same tensors as bf16 but Qwen3's fp32 norms, at twice the bytes; a CPU multiplies it 3x faster), and bf16
# where the attention is widest
CASES = [(family, *shape, "float32") for family in ("Llama", "Qwen2", "Qwen3", "Phi3") for shape in SHAPES] + [
    ("Llama", *SHAPES[0], "bfloat16"), ("Qwen3", *SHAPES[3], "bfloat16"), ("Phi3", *SHAPES[0], "bfloat16")]
BATCH, LENGTH, VOCAB = 2, 256, 1024


@pytest.fixture(scope="module")
def peaks() -> dict[tuple, list[int]]:
    """Each case's [layers, whole forward] peaks (tests/eval_forward_probe.py), in this process: without gradients no
    autograd graph exists that something another test left could extend, and the worker has transformers imported."""
    import eval_forward_probe
    import torch

    names = ("family", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "dtype")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peaks do not depend on it; a loaded machine's two cores shared by two threads do
    try:
        return {c: eval_forward_probe.peaks(**dict(zip(names, c, strict=True)), batch=BATCH, length=LENGTH,
                                            vocab=VOCAB, tile=list(TILE)) for c in CASES}  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _setup(family: str, hidden: int, intermediate: int, heads: int, kv: int, head_dim: int, dtype: str) -> memory.Setup:
    arch = memory.Arch(2, hidden, intermediate, heads, kv, VOCAB, head_dim=head_dim, fused_mlp=family == "Phi3")
    return memory.Setup(arch, trainer="sft", eval_batch=BATCH, seq_len=LENGTH, weights_dtype=dtype,
                        mixed_precision=dtype != "float32")  # fmt: skip


@pytest.mark.e2e
@ONE_WORKER
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_an_evaluation_forward_holds_what_the_memory_model_counts(peaks, case, monkeypatch):
    backbone, whole = peaks[case]
    setup = _setup(*case)
    compute = memory.DTYPE_BYTES[case[-1]]
    layers = memory.eval_layer(setup.arch) * BATCH * LENGTH * compute
    # the layers: within 3% under (rotary tables and the norms' statistics) and 25% over (the attention's term is the
    # largest of the three families': Qwen3's q and k norms work in fp32)
    assert 0.97 * backbone <= layers <= 1.25 * backbone, (backbone, layers)
    monkeypatch.setattr(memory, "HEAD_TILE", TILE)
    counted = memory.eval_forward(setup)
    # with TRL's head: CPU folds each tile with fp32 temporaries of its own (a GPU folds it in place: Triton), and the
    # per-token statistics in fp32, which the model leaves out
    left_out = 8 * TILE[0] * TILE[1] * 4 + BATCH * LENGTH * 4 * 12
    assert 0.97 * whole <= counted + left_out and counted <= 1.25 * whole, (whole, counted)


@pytest.mark.e2e
@ONE_WORKER
def test_evaluation_forwards_the_eval_batch_with_the_gradients_freed(tiny_qwen3, tmp_path):
    """Read back from TRL's SFTTrainer on CPU: each evaluation forward takes per_device_eval_batch_size sequences (8,
    transformers' default, against a training batch of 1), and no parameter holds a gradient then (the training
    loop's model.zero_grad() sets them to None before it evaluates), which eval_memory.forward counts."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    seen: list[tuple[int, bool]] = []

    class Watch(TrainerCallback):
        def on_prediction_step(self, args, state, control, model=None, **kwargs):
            seen.append((-1, any(p.grad is not None for p in model.parameters())))

    rows = Dataset.from_dict({"text": [f"row {i} " * 8 for i in range(16)]})
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, eval_strategy="steps",
                     eval_steps=1, max_length=32, report_to=[], use_cpu=True, save_strategy="no",
                     dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    assert args.per_device_eval_batch_size == 8  # the default this check is about
    trainer = SFTTrainer(model=str(tiny_qwen3), args=args, train_dataset=rows, eval_dataset=rows,
                         callbacks=[Watch()])  # fmt: skip
    batches: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, a, kw: batches.append(kw["input_ids"].shape[0]) if not module.training else None,
        with_kwargs=True,
    )
    with torch.autograd.set_grad_enabled(True):
        trainer.train()
    assert seen and not any(grads for _, grads in seen), seen
    assert batches and set(batches) == {8}, batches  # 16 rows: two forwards of 8


@pytest.mark.e2e
@ONE_WORKER
def test_grpo_evaluation_generates_the_eval_batch_at_once_then_forwards_it(tiny_qwen3, tmp_path):
    """Read back from TRL's GRPOTrainer on CPU (transformers' generate, use_vllm false): training generates its
    generation batch (2 completions), the evaluation per_device_eval_batch_size at once (8, however small the training
    batch), then forwards those 8 rows without gradients, which eval_memory counts; and TRL's own rule for the eval
    batch (whole groups of num_generations_eval over the processes) refuses what check_evaluation never offers."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_dict({"prompt": [f"row {i} says" for i in range(4)]})
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, eval_strategy="steps", eval_steps=1, report_to=[], use_cpu=True,
                      save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    assert (args.per_device_eval_batch_size, args.generation_batch_size) == (8, 2)
    trainer = GRPOTrainer(model=str(tiny_qwen3), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=prompts, eval_dataset=prompts)  # fmt: skip
    generated: list[tuple[int, bool]] = []
    generate = trainer.model.generate

    def watched(*a, **kw):
        generated.append((kw["input_ids"].shape[0], trainer.model.training))
        return generate(*a, **kw)

    trainer.model.generate = watched
    forwards: list[tuple[int, bool]] = []
    trainer.model.register_forward_pre_hook(
        lambda module, a, kw: forwards.append((kw["input_ids"].shape[0], torch.is_grad_enabled()))
        if not module.training and "input_ids" in kw else None, with_kwargs=True)  # fmt: skip
    with torch.autograd.set_grad_enabled(True):
        trainer.train()
    assert generated == [(2, True), (8, False)], generated  # 4 prompts x num_generations_eval 2: one batch of 8
    assert forwards and set(forwards) == {(8, False)}, forwards
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    trl = {**paired.trl, "use_vllm": False, "per_device_train_batch_size": 2, "max_completion_length": 4,
           "num_generations": 2, "eval_strategy": "steps"}  # fmt: skip
    setup = fit.setup_of("grpo", trl, paired.accelerate, 1)
    assert (setup.generation_rows, setup.eval_batch) == (2, 8)
    counted = eval_memory.generation(setup).parts["generation"] * memory.GIB  # the 8 completions, not the 2
    assert counted == pytest.approx(generation_memory.forward(memory.with_(setup, generation_rows=8)))
    # TRL's GRPOConfig at the world size of an offered fix (test_grpo_evaluation_..._in_whole_groups below)
    at_world = type("AtWorld", (GRPOConfig,), {"world_size": property(lambda self: 8)})
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                  num_generations=16, eval_strategy="steps")  # fmt: skip
    at_world(per_device_eval_batch_size=28, **common)
    with pytest.raises(ValueError, match="must be divisible by the number of generations used for evaluation"):
        at_world(per_device_eval_batch_size=29, **common)
    # orch's own check of that rule before launch (core/batch.check_eval_generations) refuses what TRL refuses, and
    # TRL takes each eval batch it offers instead
    from orchestrator.core import batch

    for processes, group, per_device in itertools.product((1, 2, 3, 8), (2, 4, 6, 16), range(1, 13)):
        world = type("AtWorld", (GRPOConfig,), {"world_size": property(lambda self, n=processes: n)})
        given = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=group,
                     num_generations=group, eval_strategy="steps", per_device_eval_batch_size=per_device)  # fmt: skip
        try:
            batch.check_eval_generations(given, "grpo", 8, processes)
        except OrchError as exc:
            with pytest.raises(ValueError, match="used for evaluation"):
                world(**given)
            for offered in re.search(r"use per_device_eval_batch_size=(.*)$", str(exc)).group(1).split(" or "):
                world(**{**given, "per_device_eval_batch_size": int(offered)})
        else:
            world(**given)


@pytest.mark.unit
def test_grpo_evaluation_that_does_not_fit_is_refused_with_an_eval_batch_in_whole_groups():
    """Phi-3-mini GRPO without vLLM (32 KV heads: its cache outgrows a layer's working tensors) trains at 2 completions
    a device in ~44 GiB of an H100; its evaluation generates 32 at once (~80 GiB) before its forward (~43). The fix is
    the largest eval batch that fits and that TRL takes: over 8 processes, whole groups of num_generations=16, so 28,
    not the 29 that would fit; --auto-fit applies it (a DoesNotFit)."""
    from orchestrator.core.errors import DoesNotFit

    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    trl = {**paired.trl, "model_name_or_path": "microsoft/Phi-3-mini-4k-instruct", "use_vllm": False,
           "per_device_train_batch_size": 2, "num_generations": 16, "max_completion_length": 3000,
           "eval_strategy": "steps", "per_device_eval_batch_size": 32}  # fmt: skip
    setup = fit.setup_of("grpo", trl, paired.accelerate, 8, global_batch=64)
    making, during = eval_memory.generation(setup), eval_memory.forward(setup)
    assert setup.eval_group == 16 and making.gib > 76 > 45 > during.gib > memory.estimate(setup).gib - 1
    assert eval_memory.estimate(setup) == making
    with pytest.raises(DoesNotFit) as refused:
        fit.check_gpu(setup, 80, "H100")
    said = str(refused.value)
    assert said.startswith("evaluation at per_device_eval_batch_size=32 (32 completions generated at once, then "
                           "112384 tokens a forward) needs ~79.7 GiB per GPU (") and "generation 43.1" in said, said
    assert said.endswith("; set per_device_eval_batch_size=28 (~73.8 GiB)") and refused.value.overrides == {
        "per_device_eval_batch_size": "28"}, said  # fmt: skip
    usable = 80 * fit.USABLE_FRACTION
    assert eval_memory.estimate(memory.with_(setup, eval_batch=29)).gib <= usable  # fits, but TRL refuses it
    fit.check_gpu(fit.setup_of("grpo", {**trl, "per_device_eval_batch_size": 28}, paired.accelerate, 8,
                               global_batch=64), 80, "H100")  # fmt: skip
    # with no eval batch in whole groups that fits, eval_strategy=no
    with pytest.raises(OrchError, match=r"any per_device_eval_batch_size TRL takes \(x 8 processes, whole groups of "
                       r"num_generations_eval=16\): eval_strategy=no"):  # fmt: skip
        fit.check_evaluation(memory.with_(setup, eval_batch=2, seq_len=200_000, completion_len=199_000), 80, "H100")


def _qwen3_long(**trl) -> memory.Setup:
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen3_sft_long.yaml",
                           "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_cp_qwen3.yaml"})  # fmt: skip
    setup = fit.setup_of("sft", {**paired.trl, "packing": False, **trl}, paired.accelerate, 8)  # the recipe's packing
    assert setup is not None
    return setup


@pytest.mark.unit
@pytest.mark.parametrize("value, strategy", [(None, None), ("no", None), (" NO ", None), (False, None),
                                             ("steps", "steps"), ("Epoch", "epoch")])  # fmt: skip
def test_the_memory_check_and_the_data_check_read_eval_strategy_alike(value, strategy):
    """One reading of eval_strategy (core/overrides.eval_strategy) for the memory estimate's eval batch and the data
    check's test split: YAML's unquoted no (false) evaluates nothing in either."""
    from orchestrator.core import overrides
    from orchestrator.launch import recipe, resolved

    assert overrides.eval_strategy(value) == strategy
    trl = {} if value is None else {"eval_strategy": value}
    assert (_qwen3_long(**trl).eval_batch > 0) == (strategy is not None)
    launch = resolved.resolve(recipe.load("qwen3_sft_fsdp_cp"))
    assert "eval_strategy" not in launch.settings
    launch = launch.replace(paired=launch.paired._replace(trl={**launch.paired.trl, **trl}))
    assert launch.evaluation == (None if strategy is None else (strategy, "test"))


@pytest.mark.unit
def test_an_evaluation_that_does_not_fit_is_refused_with_the_eval_batch_that_does():
    """qwen3_sft_long (Qwen3-8B, 1 x 32768 tokens, context parallel) trains in ~33 GiB of an A100-40GB; evaluating at
    transformers' default 8 x 32768 tokens a forward (no CP split there: TRL's prediction_step runs none) needs ~53,
    8 GiB of it the seq x seq mask transformers builds for a padded batch under SDPA (accelerate's context-parallel
    hooks drop it at each attention, not in the model: core/dense_attention.py)."""
    quiet = _qwen3_long()
    assert quiet.eval_batch == 0 and eval_memory.estimate(quiet) is None  # no eval_strategy: nothing evaluates
    setup = _qwen3_long(eval_strategy="steps")
    assert setup.eval_batch == 8
    assert memory.estimate(setup).gib <= 40 * fit.USABLE_FRACTION < eval_memory.estimate(setup).gib
    with pytest.raises(OrchError) as refused:
        fit.check_gpu(setup, 40, "A100")
    said = str(refused.value)
    assert said.startswith("evaluation at per_device_eval_batch_size=8 (262144 tokens a forward) needs ~53.")
    assert "attention mask 8.0" in said and "flash" not in said  # context parallelism runs SDPA alone
    fits = int(re.search(r"set per_device_eval_batch_size=(\d+) \(", said).group(1))
    usable = 40 * fit.USABLE_FRACTION
    assert eval_memory.estimate(memory.with_(setup, eval_batch=fits)).gib <= usable
    assert eval_memory.estimate(memory.with_(setup, eval_batch=fits + 1)).gib > usable  # the largest that fits
    fit.check_gpu(_qwen3_long(eval_strategy="steps", per_device_eval_batch_size=fits), 40, "A100")
    fit.check_gpu(setup, 80, "H100")  # fits there
    # an eval batch from outside, however large, is answered at once (bisection), and one that cannot fit says so
    with pytest.raises(OrchError, match=r"evaluation at per_device_eval_batch_size=1000000000 .*set "
                       rf"per_device_eval_batch_size={fits} "):  # fmt: skip
        fit.check_gpu(memory.with_(setup, eval_batch=10**9), 40, "A100")
    with pytest.raises(OrchError, match=r"does not fit at per_device_eval_batch_size=1 either: eval_strategy=no"):
        fit.check_evaluation(memory.with_(setup, seq_len=400_000), 40, "A100")


@pytest.mark.unit
def test_evaluation_keeps_the_states_but_the_gradients_the_step_freed():
    """DDP's reducer keeps its buckets, ZeRO-3 its gradient partition and bucket; FSDP2, ZeRO-1 and 2 hold no gradient
    between steps."""
    arch = models.KNOWN_ARCHS["meta-llama/llama-3.1-8b-instruct"]
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        setup = memory.Setup(arch, strategy=strategy, gpus=8, micro_batch=1, eval_batch=4, seq_len=2048)
        training, during = memory.estimate(setup).parts, eval_memory.estimate(setup).parts
        assert (during["weights"], during["optimizer"], during["frozen weights"]) == (
            training["weights"], training["optimizer"], training["frozen weights"])  # fmt: skip
        kept = {"ddp": training["gradients"] / 2, "zero3": training["gradients"]}.get(strategy, 0.0)
        assert during["gradients"] == pytest.approx(kept), strategy
        assert during["gradient bucket"] == (training["gradient bucket"] if strategy == "zero3" else 0.0)
        assert "activations" not in during and during["evaluation forward"] > 0
    dpo = memory.Setup(arch, trainer="dpo", eval_batch=4, seq_len=2048)
    assert memory.eval_forward(dpo) == pytest.approx(2 * memory.eval_forward(memory.with_(dpo, trainer="sft")))
    phi3 = models.KNOWN_ARCHS["microsoft/phi-3-mini-4k-instruct"]
    assert phi3.fused_mlp and memory.Arch.from_config({"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 8,
        "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 10}).fused_mlp  # fmt: skip
    accel = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_grpo.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    grpo = fit.setup_of("grpo", {**accel.trl, "eval_strategy": "steps"}, accel.accelerate, 8)
    assert grpo is not None and (grpo.eval_batch, grpo.eval_group) == (8, 8)  # its forward; vLLM generates
    assert eval_memory.generation(grpo) is None and eval_memory.estimate(grpo) == eval_memory.forward(grpo)
    for off in ("no", False, "NO"):
        assert _qwen3_long(eval_strategy=off).eval_batch == 0


@pytest.mark.cli
def test_the_dry_run_shows_evaluation_memory_and_the_launch_refuses_what_does_not_fit(project):
    from conftest import orch

    env = {"ORCH_DATA_CHECK": "off", "ORCH_REHEARSAL": "off", "HF_TOKEN": "x"}
    base = ["run", "qwen3_sft_fsdp_cp", "--secret", "HF_TOKEN", "--dry-run", "--skip-optimizer", "eval_strategy=steps"]
    shown = orch(*base, env=env, cwd=project)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert re.search(r"^memory while evaluating: ~53\.\d GiB per GPU \(.*evaluation forward 26\.0, attention mask "
                     r"8\.0.*\) at "
                     r"per_device_eval_batch_size=8 \(262144 tokens a forward\) \(eval_strategy\)$", shown.stdout,
                     re.M), shown.stdout  # fmt: skip
    refused = orch(*base, "--gpus", "A100:8", env=env, cwd=project)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "orch: error: evaluation at per_device_eval_batch_size=8"), refused.stderr  # fmt: skip


@pytest.mark.unit
def test_plan_holds_the_evaluation_where_the_run_evaluates(plan):
    """`orch plan --eval-batch N` plans each row for the larger of the step and an evaluation of N sequences, as the
    launch check refuses it; the one-configuration estimate shows both."""
    args = ("Qwen/Qwen3-8B", "--batch", "1", "--max-length", "32768", "--cp", "2")
    bare, evaluating = plan(*args), plan(*args, "--eval-batch", "8")
    assert bare.returncode == 0 and evaluating.returncode == 0, bare.stderr + evaluating.stderr
    assert evaluating.stdout.splitlines()[0].endswith(", evaluating 8 at a time")
    rows = {line.split()[0]: line.split() for line in evaluating.stdout.splitlines()[2:] if "FSDP2" in line}
    before = {line.split()[0]: line.split() for line in bare.stdout.splitlines()[2:] if "FSDP2" in line}
    assert before["H100"][5] == "33.1" and rows["H100"][5] == "53.1"  # 1 x 8 either way, the peak the evaluation's
    # its forward and mask (34 GiB) are the same on any number of GPUs, and no A100-40GB holds them beside the states
    a100 = next(line.split() for line in evaluating.stdout.splitlines() if line.startswith("A100 "))
    assert before["A100"][1:3] == ["1", "x"] and a100[1:4] == ["-", "none", "up"], evaluating.stdout
    one = plan(*args, "--eval-batch", "8", "--strategy", "fsdp", "--gpus", "8")
    assert re.search(r"^evaluating: ~53\.1 GiB per GPU \(.*evaluation forward 26\.0, attention mask 8\.0", one.stdout,
                     re.M), one.stdout  # fmt: skip
    refused = plan("Qwen/Qwen2.5-1.5B-Instruct", "--eval-batch", "0")
    assert refused.returncode == 2 and "--eval-batch 0: give a positive whole number" in refused.stderr, refused.stderr
    # GRPO without vLLM: its evaluation generates the eval batch at once (test_grpo_evaluation_... below)
    grpo = ("microsoft/Phi-3-mini-4k-instruct", "--trainer", "grpo", "--generate", "2", "--batch", "2",
            "--max-completion-length", "3000", "--strategy", "ddp", "--gpus", "8", "--eval-batch", "32")  # fmt: skip
    shown = plan(*grpo)
    assert shown.returncode == 0 and re.search(r"^evaluating: ~79\.7 GiB per GPU \(.*generation 43\.1", shown.stdout,
                                               re.M), shown.stdout + shown.stderr  # fmt: skip


@pytest.mark.cli
def test_the_head_node_checks_the_evaluation_against_its_own_gpus(tmp_path):
    """`sky launch recipes/qwen3_sft_fsdp_cp.yaml --gpus A100:8` with eval_strategy=steps: the head node, which reads
    its own GPUs, refuses what the launch side would have, and says the evaluation's figure where it fits."""
    from test_node_memory import SETUP_ENV, _nvidia_smi, rehearse

    env = {**SETUP_ENV, "TRL_CONFIG": "recipes/trl/qwen3_sft_long.yaml", "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n",
           "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_cp_qwen3.yaml",
           "TRL_OVERRIDES": "packing=false eval_strategy=steps"}  # the recipe's packing=false, and an evaluation
    a100 = rehearse(env, path=_nvidia_smi(tmp_path, "NVIDIA A100-SXM4-40GB, 40960\\n" * 8))
    assert a100.returncode == 2 and a100.stderr.startswith(
        "orch: error: evaluation at per_device_eval_batch_size=8 (262144 tokens a forward) needs ~53."), a100.stderr
    # where it fits (qwen25_sft_ddp, whose host memory this machine has), the node's line gives the figure
    small = {**SETUP_ENV, "TRL_OVERRIDES": "eval_strategy=steps per_device_eval_batch_size=16"}
    h100 = rehearse(small, path=_nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3, 81559\\n" * 8))
    assert h100.returncode == 0, h100.stderr
    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_sft.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    setup = fit.setup_of("sft", {**paired.trl, "eval_strategy": "steps", "per_device_eval_batch_size": 16},
                         paired.accelerate, 16)  # fmt: skip
    during = eval_memory.estimate(setup)
    assert during is not None and f" GiB per GPU training, ~{during.gib:.1f} GiB evaluating, " in h100.stdout
