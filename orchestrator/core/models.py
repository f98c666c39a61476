"""Facts about the model families orch's recipes use, as plain data (no transformers import).

Used by smoke mode and the rehearsal (which tiny architecture to build) and by checks on the launch side (which
decoder layer FSDP must wrap). A family is matched by the model's config.json `model_type` where it was read
(node/model_config.py reads it), else by the Hugging Face id's family name, case-insensitive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.core.errors import OrchError
from orchestrator.core.memory import Arch
from orchestrator.core.overrides import truthy


@dataclass(frozen=True)
class Family:
    model_type: str
    """transformers' model_type (AutoConfig.for_model key)."""
    decoder_layer: str
    """Class FSDP wraps as one unit (fsdp_transformer_layer_cls_to_wrap)."""
    markers: tuple[str, ...]
    """Lower-case substrings of Hugging Face ids of this family."""


FAMILIES = (
    Family("phi3", "Phi3DecoderLayer", ("phi-3", "phi3", "phi-4", "phi4")),
    Family("qwen3", "Qwen3DecoderLayer", ("qwen3",)),
    Family("qwen2", "Qwen2DecoderLayer", ("qwen2",)),
    Family("llama", "LlamaDecoderLayer", ("llama",)),
)


# Shapes of the models the recipes use, from their config.json on the Hub (num_hidden_layers, hidden_size,
# intermediate_size, num_attention_heads, num_key_value_heads, vocab_size, head_dim, tie_word_embeddings,
# max_position_embeddings). The memory model (core/memory.py) works from these; tests/test_memory.py checks each one's
# parameter count against its model card.
KNOWN_ARCHS = {
    "microsoft/phi-3-mini-4k-instruct": Arch(32, 3072, 8192, 32, 32, 32064, positions=4096, fused_mlp=True),
    "meta-llama/llama-2-7b-hf": Arch(32, 4096, 11008, 32, 32, 32000, positions=4096),
    "meta-llama/llama-2-70b-hf": Arch(80, 8192, 28672, 64, 8, 32000, positions=4096),
    "meta-llama/llama-3.1-8b": Arch(32, 4096, 14336, 32, 8, 128256, positions=131072),
    "meta-llama/llama-3.1-8b-instruct": Arch(32, 4096, 14336, 32, 8, 128256, positions=131072),
    "meta-llama/llama-3.1-70b": Arch(80, 8192, 28672, 64, 8, 128256, positions=131072),
    "meta-llama/llama-3.1-70b-instruct": Arch(80, 8192, 28672, 64, 8, 128256, positions=131072),
    "meta-llama/llama-3.3-70b-instruct": Arch(80, 8192, 28672, 64, 8, 128256, positions=131072),
    "qwen/qwen2.5-0.5b-instruct": Arch(24, 896, 4864, 14, 2, 151936, tied=True, positions=32768),
    "qwen/qwen2.5-1.5b-instruct": Arch(28, 1536, 8960, 12, 2, 151936, tied=True, positions=32768),
    "qwen/qwen3-1.7b": Arch(28, 2048, 6144, 16, 8, 151936, head_dim=128, tied=True, positions=40960),
    "qwen/qwen3-8b": Arch(36, 4096, 12288, 32, 8, 151936, head_dim=128, positions=40960),
}


def arch_of(model_id: str, config: Mapping | None = None, where: str = "") -> Arch | None:
    """A known model's shape, else `config`'s (its config.json as node/model_config.read read it, from a local
    directory or the Hub: `where`); None when orch cannot know it."""
    known = KNOWN_ARCHS.get(model_id.lower())
    if known is not None:
        return known
    if config is None:
        return None
    try:
        return Arch.from_config(dict(config))
    except KeyError as exc:
        raise OrchError(f"{where or model_id}: a config.json the memory estimate cannot read (it has no "
                        f"{exc.args[0]}, which a decoder's config gives)") from None  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise OrchError(f"{where or model_id}: a config.json the memory estimate cannot read ({exc})") from None


def quantized(model_id: str, config: Mapping | None, where: str = "") -> str | None:
    """The TRL setting a bitsandbytes-quantised checkpoint loads as (`load_in_4bit`, `load_in_8bit`: the same
    quantizer of transformers', which the rehearsal then runs), None for a full-precision one; an OrchError for another
    quantisation method (GPTQ, AWQ, FP8...), whose kernels the nodes do not install and whose weights the memory
    estimate does not count."""
    settings = (config or {}).get("quantization_config")
    if not isinstance(settings, Mapping):
        return None
    method = str(settings.get("quant_method") or "").lower()
    if method == "bitsandbytes":
        eight = truthy(settings.get("load_in_8bit") or settings.get("_load_in_8bit") or False)
        four = truthy(settings.get("load_in_4bit") or settings.get("_load_in_4bit") or False)
        return "load_in_8bit" if eight and not four else "load_in_4bit"
    source = where or "its config.json"
    raise OrchError(
        f"model {model_id!r} is a {method or 'quantised'} checkpoint (quantization_config in {source}); orch rehearses "
        "and estimates full-precision and bitsandbytes checkpoints only: train its unquantised original (with use_peft "
        "and load_in_4bit for QLoRA)"
    )


def family_of(model_id: str, config: Mapping | None = None, where: str = "") -> Family:
    """The model's family: by `config`'s model_type where its config.json was read (node/model_config.py reads it,
    `where` names it), else by the id's name."""
    known = ", ".join(f.model_type for f in FAMILIES)
    if config is not None:
        model_type = config.get("model_type")
        for family in FAMILIES:
            if family.model_type == model_type:
                quantized(model_id, config, where)  # one orch can rehearse
                return family
        raise OrchError(
            f"model {model_id!r} is a {model_type} model (model_type in {where or 'its config.json'}); smoke mode and "
            f"the rehearsal build tiny models of {known} only: train one of those, or launch it unrehearsed "
            "(--no-rehearsal --env ORCH_REHEARSAL=off; not --smoke)"
        )
    lowered = model_id.lower()
    for family in FAMILIES:
        if any(marker in lowered for marker in family.markers):
            return family
    raise OrchError(
        f"model {model_id!r} is not of a family orch knows ({known}); "
        "smoke mode and the FSDP wrap check need one: pick a recipe of a known family"
    )
