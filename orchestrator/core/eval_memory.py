"""Per-GPU memory while the trainer evaluates (an eval_strategy), beside the training states: the launch check refuses
an evaluation that does not fit with the per_device_eval_batch_size that does (core/fit.check_evaluation), where a
run met its OOM at its first evaluation, hours in.

Every trainer evaluates with forwards of per_device_eval_batch_size rows (transformers' default 8, whatever the
training batch; tests/test_eval_memory.py reads it back from TRL's SFTTrainer). GRPO and RLOO first generate a
completion for each of those rows, all at once (TRL 1.16's _prepare_inputs in eval mode: "local generation batch ==
local eval batch", no steps_per_generation), then score them with the same forward in prediction_step: without vLLM
the generation at per_device_eval_batch_size rows (core/generation_memory.py) may be the larger of the two, where a
training step with a smaller generation batch fit (tests/test_eval_memory.py reads the rows back from TRL's
GRPOTrainer). With vLLM the engine generates, in its own share of the GPU (core/vllm_fit.with_vllm holds it).
"""

from __future__ import annotations

from orchestrator.core import dense_attention, generation_memory, memory, trainers


def forward(setup: memory.Setup) -> memory.Estimate | None:
    """Per-GPU memory of the evaluation's forward, None where the trainer does not evaluate: the training states less
    the gradients the step's zero_grad freed (DDP's reducer keeps its buckets, ZeRO-3 its gradient partition and
    bucket), and the evaluation forward (memory.eval_forward) where the training step's activations were."""
    if setup.eval_batch < 1:
        return None
    parts = memory.between_steps(setup)
    mask = dense_attention.evaluation(setup, memory.compute_bytes(setup))[0]  # through the forward: shown apart
    parts |= {"evaluation forward": memory.eval_forward(setup) - mask, "attention mask": mask,
              "gathered": memory.transient(setup, backward=False),
              "gradient bucket": memory.ds_bucket(setup) if setup.strategy == "zero3" else 0.0}  # fmt: skip
    return memory.with_overhead(setup, parts)


def generates(setup: memory.Setup) -> bool:
    """A GRPO or RLOO evaluation that generates its per_device_eval_batch_size completions with transformers' generate
    (use_vllm false, as its training does)."""
    return setup.eval_batch >= 1 and setup.generation_rows > 0 and trainers.spec(setup.trainer).generates


def generation(setup: memory.Setup) -> memory.Estimate | None:
    """Per-GPU memory while such an evaluation generates (`generates`), None where it does not."""
    return generation_memory.estimate(memory.with_(setup, generation_rows=setup.eval_batch)) if generates(setup) \
        else None  # fmt: skip


def estimate(setup: memory.Setup) -> memory.Estimate | None:
    """The evaluation's peak: its forward, or a GRPO/RLOO evaluation's generation where that holds more."""
    during, making = forward(setup), generation(setup)
    return making if making and during and making.gib > during.gib else during


def words(setup: memory.Setup) -> str:
    """The evaluation batch as the estimate takes it."""
    tokens = f"{memory.eval_tokens(setup)} tokens a forward"
    if generates(setup):
        return (f"per_device_eval_batch_size={setup.eval_batch} ({setup.eval_batch} completions generated at once, "
                f"then {tokens})")  # fmt: skip
    return f"per_device_eval_batch_size={setup.eval_batch} ({tokens})"
