"""The most bytes transformers' decoder layers hold at once on CPU, with a given attn_implementation and batch: a
training step (forward and backward, with or without gradient checkpointing) or an evaluation forward.
`python tests/dense_attention_probe.py '<json cases>'` prints a JSON list of the peaks, and last what TRL's SFT
collator makes of two sequences padding-free. Used by tests/test_dense_attention_memory.py.

A batch is "full" (no padding: SDPA takes is_causal, no mask), "padded" (a quarter of the first row is padding) or
"flattened" (TRL's padding-free rows: one row, position_ids restarting at each sequence). torch's SDPA converts a
boolean mask to its bias before it picks a kernel, on any device, and its CPU kernel, like CUDA's, keeps the bias
for the backward; CPU's flash kernel holds no scores, as CUDA's memory-efficient one."""

import json
import sys

import torch
import transformers
from lm_head_probe import LiveBytes

VOCAB = 128


def peak(family: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, batch: int, length: int,
         dtype: str, attention: str, shape: str, phase: str) -> int:  # fmt: skip
    config = getattr(transformers, f"{family}Config")(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=batch * length,
        attn_implementation=attention, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(getattr(torch, dtype))
    if phase == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(phase != "eval")
    if shape == "flattened":
        ids = torch.randint(0, VOCAB, (1, batch * length))
        inputs = {"position_ids": torch.arange(length).repeat(batch)[None]}
    else:
        ids = torch.randint(0, VOCAB, (batch, length))
        mask = torch.ones_like(ids)
        if shape == "padded":
            mask[0, -length // 4 :] = 0
        inputs = {"attention_mask": mask}
    held = [ids, *inputs.values(), *model.parameters(), *model.buffers()]
    with torch.set_grad_enabled(phase != "eval"), LiveBytes(held) as count:
        out = model.model(input_ids=ids, use_cache=False, **inputs).last_hidden_state
        if phase != "eval":
            out.float().pow(2).mean().backward()
    return count.peak


def collated() -> dict:
    """What TRL's SFT collator hands the model padding-free (packing's bfd strategies): the shapes."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    )
    return {k: batch[k].tolist() for k in ("input_ids", "position_ids")} | {"attention_mask": "attention_mask" in batch}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([peak(**case) for case in json.loads(sys.argv[1])]))
    print(json.dumps(collated()))
