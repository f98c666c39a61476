"""Smoke mode: a tiny random model of the recipe's architecture, a tokenizer trained here, synthetic data.

Everything is built on this machine in seconds, with no network, and cached by content under
$ORCH_CACHE_DIR (default ~/.cache/orch): the cache key hashes this file, the model family and the trainer,
so editing the builder rebuilds. The launch side only computes paths and overrides (`plan`); the build
runs in a subprocess (`python -m orchestrator.smoke ...`) so that `orch` itself never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import OrchError
from orchestrator.models import family_of

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
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS = 128
STEPS = 8


@dataclass(frozen=True)
class SmokePlan:
    model_type: str
    trainer: str
    dir: Path
    """Cache directory holding model/ (weights + tokenizer) and data/ (train.jsonl)."""

    @property
    def ready(self) -> bool:
        return (self.dir / "READY").is_file()


def cache_root(env: dict | os._Environ = os.environ) -> Path:
    return Path(env.get("ORCH_CACHE_DIR") or Path.home() / ".cache" / "orch") / "smoke"


def plan(model_id: str, trainer: str, root: Path | None = None) -> SmokePlan:
    """Pure apart from reading this file: where the artifacts for (model family, trainer) live."""
    family = family_of(model_id)
    digest = hashlib.sha256(Path(__file__).read_bytes() + f"{family.model_type}/{trainer}".encode()).hexdigest()
    root = cache_root() if root is None else root
    return SmokePlan(family.model_type, trainer, root / f"{family.model_type}-{trainer}-{digest[:12]}")


def trl_overrides(smoke: SmokePlan) -> dict[str, str]:
    """TRL arguments that point a recipe at the tiny artifacts and make it short, fp32 and CPU-friendly."""
    out = {
        "model_name_or_path": str(smoke.dir / "model"),
        "dataset_name": str(smoke.dir / "data"),
        "dataset_train_split": "train",
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "use_liger_kernel": "false",
        "max_steps": str(STEPS),
        "per_device_train_batch_size": "1",
        "learning_rate": "2e-3",
        "lr_scheduler_type": "constant",
        "warmup_steps": "0",
        "logging_steps": "1",
        "save_strategy": "steps",
        "save_steps": "4",
        "save_total_limit": "2",
        "bf16": "false",
        "gradient_checkpointing": "false",
        "report_to": "none",
        "disable_tqdm": "true",
        "dataloader_num_workers": "0",
        "ddp_find_unused_parameters": "false",
        "seed": "42",
    }
    if smoke.trainer == "grpo":
        out.update(
            num_generations="2",
            max_completion_length="8",
            use_vllm="false",
            reward_funcs="orchestrator.smoke.digit_reward",
        )
    else:
        out["max_length"] = "64"
    if smoke.trainer == "kto":
        out["per_device_train_batch_size"] = "2"  # KTO's KL term needs two samples in a micro-batch
    if smoke.trainer == "sft":
        out.update(packing="false", padding_free="false")
    return out


def ensure(smoke: SmokePlan) -> None:
    """Build the artifacts in a subprocess unless cached. Prints one progress line either way."""
    if smoke.ready:
        print(f"[orch] smoke: tiny {smoke.model_type} model and {smoke.trainer} data cached at {smoke.dir}", flush=True)
        return
    print(
        f"[orch] smoke: building tiny {smoke.model_type} model, tokenizer and {smoke.trainer} data (no network)...",
        flush=True,
    )
    cmd = [sys.executable, "-m", "orchestrator.smoke", smoke.model_type, smoke.trainer, str(smoke.dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise OrchError(f"building the smoke model failed: {tail[0]}; is the training stack installed? (make install)")
    print(f"[orch] smoke: built at {smoke.dir}", flush=True)


# ---------------------------------------------------------------- node side (imports torch/transformers)


def _rows(trainer: str, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = (a + b + rng.randint(1, 9)) % 19
        prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        good = [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        bad = [{"role": "assistant", "content": f"{a} plus {b} is {wrong}."}]
        if trainer == "sft":
            rows.append({"messages": prompt + good})
        elif trainer in ("dpo", "reward"):
            rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
        elif trainer == "kto":
            rows.append({"prompt": prompt, "completion": good, "label": True})
            rows.append({"prompt": prompt, "completion": bad, "label": False})
        elif trainer == "grpo":
            rows.append({"prompt": prompt, "answer": str(a + b)})
        else:
            raise ValueError(f"no smoke data for trainer {trainer!r}")
    return rows[:ROWS]


def digit_reward(completions, answer=None, **_) -> list[float]:
    """GRPO smoke reward: 1.0 when the completion contains the right sum, a little for any digit."""
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


def build(model_type: str, trainer: str, out: Path) -> None:
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
            **TINY,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
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
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m orchestrator.smoke MODEL_TYPE TRAINER OUT_DIR")
    build(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
