"""The most bytes transformers' generate holds at once on CPU, as GRPO and RLOO call it without vLLM: a batch of
left-padded prompts, every completion run to its full length, SDPA attention, the cache transformers picks
(DynamicCache). `python tests/generation_probe.py '<json cases>' '<json TRL cases>'` prints a JSON list of the peaks,
what TRL's GRPOConfig makes of the generation batch, and last the generation batch TRL derives for each TRL case at
its world size (`at_world`). Used by tests/test_generation_memory.py."""

import json
import sys

import torch
import transformers
from lm_head_probe import LiveBytes

VOCAB = 256


def peak(family: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, rows: int, prompt: int,
         completion: int, dtype: str) -> int:  # fmt: skip
    config = getattr(transformers, f"{family}Config")(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=prompt + completion,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(getattr(torch, dtype)).eval()
    ids = torch.randint(3, VOCAB, (rows, prompt))
    mask = torch.ones_like(ids)
    mask[0, : prompt // 4] = 0  # TRL pads prompts on the left
    generation = transformers.GenerationConfig(max_new_tokens=completion, min_new_tokens=completion, do_sample=True,
                                               pad_token_id=0, eos_token_id=2)  # fmt: skip
    held = [ids, mask, *model.parameters(), *model.buffers()]
    with torch.no_grad(), LiveBytes(held) as count:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
    assert out.shape == (rows, prompt + completion), out.shape
    return count.peak


def generation_batch() -> dict:
    """TRL's GRPOConfig on one process: the generation batch and steps_per_generation it derives."""
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                      num_generations=2, use_cpu=True, report_to="none")  # fmt: skip
    return {"steps_per_generation": args.steps_per_generation, "generation_batch_size": args.generation_batch_size,
            "ds3_gather_for_generation": args.ds3_gather_for_generation}  # fmt: skip


def at_world(cases: list[dict]) -> list:
    """TRL's own GRPOConfig or RLOOConfig for each case's settings at its world size (TrainingArguments.world_size,
    which TRL's checks read, answering the case's number of processes): [generation_batch_size,
    steps_per_generation], or TRL's refusal."""
    import trl

    made = []
    for case in cases:
        base = getattr(trl, {"grpo": "GRPOConfig", "rloo": "RLOOConfig"}[case["trainer"]])
        at = type("AtWorld", (base,), {"world_size": property(lambda self, n=case["world"]: n)})
        try:
            args = at(output_dir="unused", use_cpu=True, report_to="none", **case["settings"])
        except ValueError as exc:
            made.append(str(exc))
            continue
        made.append([args.generation_batch_size, args.steps_per_generation])
    return made


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([peak(**case) for case in json.loads(sys.argv[1])]))
    print(json.dumps(generation_batch()))
    print(json.dumps(at_world(json.loads(sys.argv[2]))))
