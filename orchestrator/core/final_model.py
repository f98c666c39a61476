"""Which files of an output_dir make the final model (weights or LoRA adapter, config, tokenizer, model card):
what `--push-to-hub` uploads and `orch pull` brings back; never checkpoints, orch's reports or curves."""

from __future__ import annotations

import fnmatch

FILES = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
    "merges.txt", "tokenizer.model", "README.md",
)  # fmt: skip


WRITTEN = "the final model's files (README.md, config.json, model.safetensors, the tokenizer's)"
"""In words, what a run writes at the top of its output_dir (refusals of an output_dir that is not the run's)."""


def is_final_file(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in FILES)


def size_words(n: float) -> str:
    """Bytes in the unit that keeps one decimal meaningful: "29.7 kB", "335.4 MB", "140.2 GB" (never "0.0 MB")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if round(n / scale, 1) >= 1:  # 999,999 bytes is "1.0 MB", not "1000.0 kB"
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def described(final: dict) -> tuple[str, str]:
    """A final model's report (train/checkpoints.final_model_files) in words: ("model.safetensors, BF16, 335.4 MB",
    who loads it). Reports written before the dtypes were read say none."""
    dtypes = " + ".join(final.get("dtypes") or [])
    files = ", ".join([*final["weights"], *([dtypes] if dtypes else []), size_words(final["bytes"])])
    adapter = "adapter_model.safetensors" in final["weights"]
    return files, ("PEFT's from_pretrained loads it on its base model" if adapter
                   else "transformers' from_pretrained loads it")  # fmt: skip
