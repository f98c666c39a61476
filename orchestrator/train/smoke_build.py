"""Smoke mode, training side: build a tiny random model of an architecture, a tokenizer and synthetic data.

`python -m orchestrator.train.smoke_build MODEL_TYPE TRAINER OUT_DIR` (run by orchestrator.core.smoke, which
decides where and caches). Nothing is downloaded. `--mib N` builds a wider model of at least N MiB in bf16 instead
(the load-memory measurements, tests/test_load_memory.py, need one large enough to see). `digit_reward` is the
GRPO smoke run's reward function.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from orchestrator.core import trainers

# Tiny shapes, as TRL's own test models (2 layers, 4 heads, 2 KV heads), a little wider so loss moves.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # hidden_size / num_attention_heads (Qwen3's default of 128 would not match)
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"]
# The assistant's turn inside `{% generation %}` markers (they render nothing): TRL's SFT trainer then masks the loss
# to it with assistant_only_loss=true, as it does for the families' real templates, which it patches (a template it
# cannot patch, as this one without markers, is refused: the rehearsal refused assistant_only_loss for every recipe).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
    "{{ message['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}{% else %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS = 128


def _rows(trainer: str, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        good = [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        # a refusal, which a tiny model learns to rank below the answer in a few steps: a smoke run's preference
        # loss falls and its reward accuracy rises (a wrong sum, one token apart, did not move in 8 steps)
        bad = [{"role": "assistant", "content": "I cannot answer that."}]
        shape = trainers.spec(trainer).format  # one row builder per TRL dataset format, not per trainer
        if shape == "conversation":
            rows.append({"messages": prompt + good})
        elif shape == "preference":
            rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
        elif shape == "unpaired":
            rows.append({"prompt": prompt, "completion": good, "label": True})
            rows.append({"prompt": prompt, "completion": bad, "label": False})
        elif shape == "prompt":
            # `answer` for the smoke reward (digit_reward); `solution`, as DeepMath-103K names it, for TRL's
            # accuracy_reward, which the GRPO and RLOO recipes score with
            rows.append({"prompt": prompt, "answer": str(a + b), "solution": f"${a + b}$"})
        else:
            raise ValueError(f"no smoke rows for dataset format {shape!r} (trainer {trainer!r})")
    return rows[:ROWS]


def digit_reward(completions, answer=None, **_) -> list[float]:
    """The smoke reward of generating trainers (GRPO, RLOO): 1.0 when the completion contains the right sum, a little
    for any digit."""
    rewards = []
    for i, completion in enumerate(completions):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        right = answer is not None and answer[i] in text
        rewards.append(1.0 if right else 0.1 * sum(ch.isdigit() for ch in text[:10]))
    return rewards


def _tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, bpe)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# A wider shape for `--mib`: decoder layers of 12.85M parameters (24.5 MiB in bf16) each
WIDE = dict(TINY, hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
            head_dim=64)  # fmt: skip


def shape(mib: int = 0) -> dict:
    """TINY, or WIDE with as many layers as make at least `mib` MiB of bf16 weights."""
    if mib <= 0:
        return TINY
    h, i = WIDE["hidden_size"], WIDE["intermediate_size"]
    per_layer = 2 * (4 * h * h + 3 * h * i)
    return dict(WIDE, num_hidden_layers=-(-mib * 2**20 // per_layer))


def build(model_type: str, trainer: str, out: Path, mib: int = 0) -> bool:
    """Build into `out` unless it is complete; False when another process sharing the cache built it meanwhile."""
    from orchestrator.core.smoke import builder_lock

    with builder_lock(out):
        if (out / "READY").is_file():
            return False
        _build(model_type, trainer, out, mib)
        return True


def _build(model_type: str, trainer: str, out: Path, mib: int) -> None:
    import shutil
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = random.Random(0)
    rows = _rows(trainer, rng)
    corpus = [json.dumps(r) for r in rows] + [f"<|{r}|>" for r in ("user", "assistant", "system")] * 4
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        tokenizer = _tokenizer(corpus)
        config = AutoConfig.for_model(
            model_type,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **shape(mib),
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if mib else torch.float32)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        (tmp / "data").mkdir()
        with open(tmp / "data" / "train.jsonl", "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        (tmp / "READY").write_text(json.dumps({"model_type": model_type, "trainer": trainer, "rows": len(rows)}))
        try:
            tmp.rename(out)  # atomic: a concurrent builder that won the race leaves `out` complete
        except OSError:
            if not (out / "READY").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    size = 0
    if len(args) == 5 and args[3] == "--mib" and args[4].isdigit():
        size, args = int(args[4]), args[:3]
    if len(args) != 3:
        raise SystemExit("usage: python -m orchestrator.train.smoke_build MODEL_TYPE TRAINER OUT_DIR [--mib N]")
    build(args[0], args[1], Path(args[2]), size)
