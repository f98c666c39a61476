"""Facts about the model families orch's recipes use, as plain data (no transformers import).

Used by smoke mode (which tiny architecture to build) and by checks on the launch side (which decoder layer
FSDP must wrap). Matching is by the Hugging Face id's family name, case-insensitive.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.errors import OrchError


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


# Parameter counts (billions, embeddings included) of the models the recipes use, from their model cards.
KNOWN_PARAMS_B = {
    "microsoft/phi-3-mini-4k-instruct": 3.82,
    "meta-llama/llama-3.1-8b-instruct": 8.03,
    "meta-llama/llama-3.1-8b": 8.03,
    "qwen/qwen2.5-0.5b-instruct": 0.494,
    "qwen/qwen2.5-1.5b-instruct": 1.54,
    "qwen/qwen3-1.7b": 2.03,
    "qwen/qwen3-8b": 8.19,
}


def params_billions(model_id: str) -> float | None:
    """Parameter count of a model id: the table above, else the size its name states (`...-70B`), else None."""
    import re

    known = KNOWN_PARAMS_B.get(model_id.lower())
    if known is not None:
        return known
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model_id.split("/")[-1])
    return float(match.group(1)) if match else None


def family_of(model_id: str) -> Family:
    lowered = model_id.lower()
    for family in FAMILIES:
        if any(marker in lowered for marker in family.markers):
            return family
    known = ", ".join(f.model_type for f in FAMILIES)
    raise OrchError(
        f"model {model_id!r} is not of a family orch knows ({known}); "
        "smoke mode and the FSDP wrap check need one: pick a recipe of a known family"
    )
