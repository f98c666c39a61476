"""Per-GPU memory while GRPO or RLOO generate with transformers' generate (use_vllm false), beside the training states:
the launch side checked the training step alone, and a run met its OOM at the first generation, or hung waiting for a
rank that had.

Read from TRL 1.16 (GRPOTrainer._generate_single_turn, trl/models/utils.unwrap_model_for_generation) and transformers 5,
and measured on CPU (tests/test_generation_memory.py):

- a rank generates its whole generation batch at once: per_device_train_batch_size x steps_per_generation completions
  (steps_per_generation defaults to the accumulation; generation_batch_size, if set, is split over the ranks);
- under ZeRO-3 it first gathers every parameter of the model on every GPU (deepspeed.zero.GatheredParameters over
  model.parameters(), unless ds3_gather_for_generation is false); FSDP2 and DDP generate as they train;
- the gradients are gone (the step's zero_grad set them to None before the next step generates);
- transformers' DynamicCache keeps k and v for every layer and token (prompt and completion), and at the end of the
  completion one layer's k and v repeated to the query heads (a padded batch passes SDPA a mask, so no GQA kernel) and
  one layer's cache copied as it grows; the prompt's forward before it holds one decoder layer's working tensors for
  every prompt token and SDPA's mask of the left-padded prompts (core/dense_attention.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core import batch, dense_attention, memory
from orchestrator.core.errors import OrchError


def rows_of(settings: Mapping[str, object], gpus: int, global_batch: int | None) -> int:
    """Completions a GRPO or RLOO rank generates at once with transformers' generate: its generation batch (TRL
    1.16's GRPOConfig: generation_batch_size over the ranks, else per_device_train_batch_size x steps_per_generation,
    which defaults to the accumulation: GLOBAL_BATCH_SIZE's where the recipe has one, as the node derives it)."""
    micro = int(str(settings.get("per_device_train_batch_size") or 8))
    if settings.get("generation_batch_size") not in (None, ""):
        return max(1, int(str(settings["generation_batch_size"])) // max(gpus, 1))
    steps = settings.get("steps_per_generation")
    if steps in (None, ""):
        steps = global_batch // (micro * gpus) if global_batch else settings.get("gradient_accumulation_steps") or 1
    return micro * max(1, int(str(steps)))


def fewer(settings: Mapping[str, object], processes: int, global_batch: int | None,
          group_default: int) -> tuple[batch.Smaller, ...]:  # fmt: skip
    """Smaller generation batches, largest first: steps_per_generation (or generation_batch_size, where the settings
    give that instead) at a divisor of the accumulation below what a rank generates now, so that every generation's
    completions train within the optimizer step of the policy that made them, in whole num_generations groups over
    the `processes` (TRL's rule). Not the same math to the bit: TRL scales the loss's token count from each generation
    batch to the accumulation window (GRPOTrainer.compute_loss)."""
    try:
        micro, steps = batch.per_device_batch(settings), batch.steps_of(settings, global_batch, processes)
        group = batch.generations(settings, group_default)
    except OrchError:
        return ()
    now = rows_of(settings, processes, global_batch) // micro
    key = "generation_batch_size" if settings.get("generation_batch_size") not in (None, "") else "steps_per_generation"
    found = []
    for s in range(min(now - 1, steps), 0, -1):
        if steps % s or micro * processes * s % group:
            continue
        value = micro * processes * s if key == "generation_batch_size" else s
        found.append(batch.Smaller(micro * s, ((key, str(value)),),
                                   f"{micro * s} completions at a time, {steps // s} generations an optimizer step"))
    return tuple(found)


def kv_bytes(setup: memory.Setup, tokens: int) -> float:
    """transformers' cache of k and v for `tokens` tokens of every row a rank generates."""
    a = setup.arch
    return 2 * a.layers * a.kv_heads * a.hd * memory.compute_bytes(setup) * setup.generation_rows * tokens


def forward(setup: memory.Setup) -> float:
    """Bytes generate holds at its peak: the prompt's forward with its cache so far, or the cache at the end."""
    a, rows, compute = setup.arch, setup.generation_rows, memory.compute_bytes(setup)
    prompt, total = setup.seq_len - setup.completion_len, setup.seq_len
    mask = dense_attention.mask_entries(rows, prompt, "padded") * (1 + compute) if setup.dense_attention else 0
    prefill = kv_bytes(setup, prompt) + memory.eval_layer(a) * rows * prompt * compute + mask
    layer_kv = kv_bytes(setup, total) / a.layers
    decode = kv_bytes(setup, total) + layer_kv * a.heads / a.kv_heads + layer_kv / 2
    return max(prefill, decode)


def gathers_all(setup: memory.Setup) -> bool:
    """ZeRO-3 gathers the whole model on every GPU: for generate (ds3_gather_for_generation, TRL's default), or to
    merge a LoRA adapter before it syncs vLLM's weights (TRL 1.16's VLLMGeneration._iter_named_params)."""
    return setup.strategy == "zero3" and setup.generation_gather


def estimate(setup: memory.Setup) -> memory.Estimate | None:
    """Per-GPU memory while the rank generates with transformers' generate, or gathers the model to sync vLLM's
    weights; None where it does neither."""
    if setup.generation_rows < 1 and not gathers_all(setup):
        return None
    parts = memory.between_steps(setup)
    weights = memory.loaded_bytes(setup) if gathers_all(setup) else 0.0  # QLoRA's base stays 4-bit
    parts |= {"generation": forward(setup) if setup.generation_rows else 0.0,
              "gathered": weights or memory.transient(setup, backward=False),
              "gradient bucket": memory.ds_bucket(setup) if setup.strategy == "zero3" else 0.0}  # fmt: skip
    return memory.with_overhead(setup, parts)


def words(setup: memory.Setup) -> str:
    """What the rank does that `estimate` counts."""
    if not setup.generation_rows:
        return ("syncing vLLM's weights (TRL 1.16 gathers the whole model on every GPU under ZeRO-3 to merge the LoRA "
                "adapter)")  # fmt: skip
    return (f"generating {setup.generation_rows} completions at once (transformers' generate, use_vllm false: "
            f"per_device_train_batch_size x steps_per_generation, each a {setup.seq_len - setup.completion_len}-token "
            f"prompt and {setup.completion_len} tokens)")


def refusal(setup: memory.Setup, usable: float) -> tuple[str, str, dict[str, str] | None]:
    """Where generating needs more than `usable` GiB: (what it needs, the fix in words or '', its settings or None),
    else ('', '', None)."""
    during = estimate(setup)
    if during is None or during.gib <= usable:
        return "", "", None
    need = f"{words(setup)} needs {during.describe()}"
    alone = estimate(memory.with_(setup, generation_gather=False)) if gathers_all(setup) else None
    if alone and alone.gib <= usable:
        fix = (f"ds3_gather_for_generation=false (~{alone.gib:.1f} GiB: ZeRO-3 then gathers a layer at a time as it "
               "generates, not the whole model on every GPU; slower)")
        return need, fix, {"ds3_gather_for_generation": "false"}
    rows = batch.first_fitting(setup.generation_fewer,
                               lambda f: (estimate(memory.with_(setup, generation_rows=f.batch)) or during).gib, usable)
    if rows is None:
        return need, "", None
    return need, f"set {rows[0].words()} (~{rows[1]:.1f} GiB: {rows[0].kept})", dict(rows[0].overrides)
