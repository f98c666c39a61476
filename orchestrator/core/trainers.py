"""The TRL trainers orch runs, one spec each. Every fact orch needs about a trainer lives here and every site reads
it: the launch side's argument checks (core/trl_schema.py), the dataset checks (core/dataset_format.py), the memory
model and `orch plan`, preflight, the node's rules and vLLM server, the training entry (which TRL class, whether it
takes reward functions), the smoke artifacts (their TRL overrides here, their rows in train/smoke_build.py by
format), the rehearsal and the one-row data check. Adding a trainer is a spec here plus its recipe files
(CONTRIBUTING.md); TRL's argument snapshot (core/trl_args.json) already holds every trainer script TRL ships.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from orchestrator.core.errors import OrchError

# The row shapes of TRL's dataset formats orch knows, for the smoke data and the one-row check (what TRL feeds the
# model): a conversation (SFT), a preference pair (chosen + rejected), an unpaired preference (completion + label),
# a prompt alone (the policy generates, reward functions score).
FORMATS = ("conversation", "preference", "unpaired", "prompt")
_CHAT = [{"role": "user", "content": "2+2?"}]


PLAIN_METRICS = ("loss", "learning_rate", "grad_norm")
"""What every step line shows first (train/callbacks.py); a trainer's own `metrics` follow them."""


@dataclass(frozen=True)
class TrainerSpec:
    name: str
    """TRL_TRAINER's value and TRL's script module, trl.scripts.<name> (its make_parser parses the arguments)."""
    trl_class: str
    """The trainer class in trl."""
    format: str
    """One of FORMATS: the smoke data's rows and what the one-row check feeds the model."""
    columns: tuple[tuple[str, ...], ...]
    """The dataset columns it reads: any one of these sets (TRL's dataset formats, conversational or standard)."""
    example: Mapping[str, object]
    """A row that would do, shown when a row lacks a column."""
    rows_per_sample: int = 1
    """Rows one sample puts in a micro-batch (a preference pair's chosen and rejected go through the model together)."""
    fused_head: bool = True
    """It scores tokens through TRL's fused LM head (core/memory.lm_head); a reward model's 1-label head does not."""
    smooths_labels: bool = False
    """With label_smoothing_factor > 0 its loss is transformers' LabelSmoother over the whole logits (SFT's
    compute_loss; the others' losses are their own): core/memory.full_logits."""
    padding_free: bool = False
    """Its collator can flatten a micro-batch into one row with position_ids restarting at each sequence (TRL 1.16's
    SFT: padding_free, on with packing's bfd strategies; DPO's is disabled in 1.16): dense_attention.batch_shape."""
    reference: str = "none"
    """A frozen reference model: "always" (TRL prepares one for full fine-tuning), "beta" (when beta != 0), "none".
    Never with PEFT: TRL disables the adapter instead."""
    beta_default: float = 0.0
    """TRL's default beta, for reference == "beta"."""
    generates: bool = False
    """The policy generates completions during training: reward functions, num_generations groups, a vLLM server."""
    generations_default: int = 0
    """TRL's default num_generations (generating trainers)."""
    min_micro_batch: int = 1
    """The smallest per_device_train_batch_size it accepts."""
    min_micro_batch_why: str = ""
    smoke_overrides: Mapping[str, str] = field(default_factory=dict)
    """TRL arguments a smoke run adds for this trainer (core/smoke.py sets the shared ones)."""
    drops_by: str = ""
    """What TRL 1.16's filter measures against max_length: "prompt" (a prompt alone that fills it; DPO only with
    truncation_mode=keep_start), "pair" (chosen or rejected longer than it); "" where it truncates instead. The
    one-row data check says whether the first row would be dropped (launch/datacheck.py)."""
    drops: str = ""
    """Which rows TRL 1.16's trainer leaves out of the training split as it prepares it (`{max_length}` and
    `{truncation_mode}` filled in from its settings): train/kept.py says how many and refuses a split left empty."""
    metrics: tuple[str, ...] = ()
    """TRL's own log keys that say how this trainer's training goes besides the loss (TRL 1.16's names; `*` stands
    for one path part, a reward function's name): each step line and the run's summary show them."""

    def headline(self, record: Mapping[str, object]) -> list[tuple[str, float]]:
        """The record's values for `metrics`, in their order (a pattern's matches in the record's order)."""
        shown = []
        for pattern in self.metrics:
            for key, value in record.items():
                if fnmatch.fnmatchcase(key, pattern) and key.count("/") == pattern.count("/"):
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        shown.append((key, float(value)))
        return shown

    def has_reference(self, settings: Mapping[str, object], peft: bool = False) -> bool:
        """Whether TRL builds a separate frozen reference model with these settings (beta from them or TRL's)."""
        if peft or self.reference == "none":
            return False
        if self.reference == "always":
            return True
        beta = settings.get("beta")
        try:
            return float(str(self.beta_default if beta in (None, "") else beta)) != 0.0
        except ValueError:
            return True  # a value TRL's parser will refuse: the checks that parse it say so

    def needs(self) -> str:
        return " or ".join(" + ".join(s) for s in self.columns)


_GENERATING_SMOKE = MappingProxyType({
    "num_generations": "2", "max_completion_length": "8", "use_vllm": "false",
    "log_completions": "false",  # tables of random tokens from the tiny model: noise in the log
})  # fmt: skip
_PAIR = MappingProxyType({"prompt": _CHAT, "chosen": [{"role": "assistant", "content": "4"}],
                          "rejected": [{"role": "assistant", "content": "5"}]})  # fmt: skip

SPECS: dict[str, TrainerSpec] = {
    spec.name: spec
    for spec in (
        TrainerSpec(
            "sft", "SFTTrainer", "conversation", (("messages",), ("text",), ("prompt", "completion")),
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
            smoke_overrides={"max_length": "64", "packing": "false", "padding_free": "false"},
            metrics=("mean_token_accuracy",), smooths_labels=True, padding_free=True,
            drops="each row left with no token to learn from once cut to max_length={max_length} "
                  "(truncation_mode={truncation_mode}: a prompt or other turns that fill it, or no completion)",
        ),
        TrainerSpec(
            "dpo", "DPOTrainer", "preference", (("chosen", "rejected"),), _PAIR, rows_per_sample=2,
            reference="always", smoke_overrides={"max_length": "64"}, metrics=("rewards/accuracies", "rewards/margins"),
            drops="each row whose prompt alone fills max_length={max_length} (truncation_mode=keep_start; keep_end "
                  "keeps them)", drops_by="prompt",
        ),
        TrainerSpec(
            "kto", "KTOTrainer", "unpaired", (("prompt", "completion", "label"),),
            {"prompt": _CHAT, "completion": [{"role": "assistant", "content": "4"}], "label": True},
            reference="always", min_micro_batch=2,
            min_micro_batch_why="its KL baseline pairs mismatched samples of one micro-batch",
            smoke_overrides={"max_length": "64", "per_device_train_batch_size": "2"}, metrics=("rewards/margins", "kl"),
            drops="each row whose prompt alone fills max_length={max_length}", drops_by="prompt",
        ),
        TrainerSpec(
            "reward", "RewardTrainer", "preference", (("chosen", "rejected"),), _PAIR, rows_per_sample=2,
            fused_head=False, smoke_overrides={"max_length": "64"}, metrics=("accuracy", "margin"),
            drops="each pair whose chosen or rejected is longer than max_length={max_length}", drops_by="pair",
        ),
        TrainerSpec(
            "grpo", "GRPOTrainer", "prompt", (("prompt",),), {"prompt": [{"role": "user", "content": "What is 2+2?"}]},
            reference="beta", beta_default=0.0, generates=True, generations_default=8,
            smoke_overrides=_GENERATING_SMOKE, metrics=("reward", "rewards/*/mean"),
        ),
        TrainerSpec(
            "rloo", "RLOOTrainer", "prompt", (("prompt",),), {"prompt": [{"role": "user", "content": "What is 2+2?"}]},
            reference="beta", beta_default=0.05, generates=True, generations_default=2,
            smoke_overrides=_GENERATING_SMOKE, metrics=("reward", "rewards/*/mean"),
        ),
    )
}  # fmt: skip
TRAINERS = tuple(SPECS)


def spec(name: str) -> TrainerSpec:
    """A TRL_TRAINER value orch runs, or one clear error."""
    if name not in SPECS:
        raise OrchError(f"TRL_TRAINER={name!r} is not a trainer orch runs; use one of {', '.join(TRAINERS)}")
    return SPECS[name]
