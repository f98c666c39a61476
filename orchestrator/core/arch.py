"""A decoder-only transformer's shape, read from its config.json: what core/memory.py counts the bytes of."""

from __future__ import annotations

from dataclasses import dataclass

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""How transformers' mixture-of-experts configs count their experts (Qwen2/3-MoE, Mixtral and GPT-OSS, DeepSeek-V3)."""
FUSED_MLP = ("phi3",)
"""model_types whose MLP projects gate and up in one linear (transformers' Phi3MLP.gate_up_proj)."""


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's shape, as its config.json gives it."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0
    tied: bool = False
    positions: int = 0
    """The positions it was trained for: config.json's max_position_embeddings, or what its rope scaling extends that
    to (positions_of); 0 where the config does not say."""
    fused_mlp: bool = False
    """The MLP's gate and up projections are one linear (Phi-3's gate_up_proj), whose output is both at once."""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linears().values())

    @property
    def other_params(self) -> int:
        """Embeddings, lm_head and norms: what 4-bit quantisation leaves in 16 bits."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_linear_params + self.other_params

    @classmethod
    def from_config(cls, config: dict) -> Arch:
        """From a Hugging Face config.json (Llama, Qwen2/3, Mistral, Phi-3 and alike). Every size must be a whole
        number >= 1 (head_dim 0 or absent: hidden / heads): a KeyError, TypeError or ValueError names what is not."""
        if not isinstance(config, dict):
            raise TypeError(f"it is a JSON {type(config).__name__}, not an object")
        text = config.get("text_config") or config
        if not isinstance(text, dict):
            raise TypeError("its text_config is not an object")

        def size(key: str, fallback: int | None = None, low: int = 1) -> int:
            """text[key]; with a fallback, that when the key is absent or null (as in many configs)."""
            value = text[key] if fallback is None else (text.get(key) or fallback)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key}={value!r} is not a whole number >= {low}")
            return value

        for key in MOE_KEYS:  # a mixture of experts counted as one dense MLP per layer would be off by its experts
            experts = text.get(key)
            if isinstance(experts, int) and not isinstance(experts, bool) and experts > 1:
                raise ValueError(f"{key}={experts}: a mixture of experts, and this estimate counts dense decoders only")
        heads = size("num_attention_heads")
        return cls(
            layers=size("num_hidden_layers"),
            hidden=size("hidden_size"),
            intermediate=size("intermediate_size"),
            heads=heads,
            kv_heads=size("num_key_value_heads", heads),
            vocab=size("vocab_size"),
            head_dim=size("head_dim", 0, low=0),
            tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            positions=positions_of(text),
            fused_mlp=text.get("model_type", config.get("model_type")) in FUSED_MLP,
        )


def positions_of(config: dict) -> int:
    """max_position_embeddings, or a rope scaling's reach where it is longer (`rope_scaling`, transformers 5's
    `rope_parameters`: factor x original_max_position_embeddings, as YaRN, linear and dynamic scaling extend a
    context); 0 where the config gives no whole number."""
    given = config.get("max_position_embeddings")
    positions = given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else 0
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if not isinstance(rope, dict) or str(rope.get("rope_type") or rope.get("type") or "default") == "default":
            continue
        factor, original = rope.get("factor"), rope.get("original_max_position_embeddings") or positions
        if isinstance(factor, (int, float)) and isinstance(original, int) and factor > 1:
            positions = max(positions, int(original * factor))
    return positions
