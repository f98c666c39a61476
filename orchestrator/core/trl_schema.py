"""TRL as data: each trainer's arguments and TRL's Accelerate profiles, for checks that need no trl installed.

`trl_args.json` beside this file is generated from TRL's own parsers and its `accelerate_configs/` folder
(`python -m orchestrator.train.snapshots`, which imports trl) and committed, so the launch side checks names
and types without importing trl, and reads a profile like `zero1` where trl is absent; a test regenerates it
and fails when the installed TRL disagrees. It records the trl / transformers / accelerate versions it came
from, which pyproject.toml pins for the nodes (a test compares them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.core import trainers
from orchestrator.core.errors import OrchError, did_you_mean

SCHEMA = Path(__file__).parent / "trl_args.json"
_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}
CONFIG_ONLY_KEYS = {"env"}  # TrlParser reads `env:` from a config file and exports it
SECRET_ARGUMENTS = {"hub_token": "HF_TOKEN"}
"""TRL arguments that hold a credential -> the secret that replaces them."""


@cache
def _schema() -> dict:
    return json.loads(SCHEMA.read_text())


def versions() -> dict[str, str]:
    """The trl / transformers / accelerate versions the argument lists were generated from."""
    return _schema()["versions"]


def profiles() -> dict[str, dict]:
    """TRL's Accelerate profiles (trl/accelerate_configs/<name>.yaml) as they were when the snapshot was made."""
    return _schema()["profiles"]


def check_trainer(trainer: str) -> str:
    """A TRL_TRAINER value orch runs (core/trainers.py), or one clear error."""
    return trainers.spec(trainer).name


def fields(trainer: str) -> dict[str, object]:
    return _schema()[check_trainer(trainer)]


def _stack() -> str:
    v = versions()
    return f"TRL {v['trl']} / transformers {v['transformers']}, the versions the nodes install"


def _list_items(value: object) -> list[str]:
    """A list argument's items: a YAML list, or an override's words, split as the node splits them
    (overrides.to_argv: `loss_type="sigmoid sft"` is two items, `sigmoid,sft` one)."""
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return str(value).split()


def _kind_ok(kind: object, value: object) -> bool:
    """A value fits an argument's kind: an override's text, or a list from a config file (list arguments)."""
    if isinstance(kind, dict):  # a list whose items have choices
        return all(item in kind["list"] for item in _list_items(value))
    text = str(value).strip()
    if isinstance(kind, list):  # choices
        return text in [str(c) for c in kind] or (text in ("None", "none") and None in kind)
    if text in ("None", "none", "null") and kind not in ("bool",):
        return True  # Optional fields take None; TRL's own parser decides for the rest
    if kind == "str|list":  # TRL's parser takes one word; a config file may give a list
        return len(text.split()) <= 1
    if kind == "config list":  # TRL's parser makes a tuple of the text's characters
        return False
    if kind in ("dict", "dict|file"):  # the config's __post_init__ reads a value that starts with { as JSON
        return isinstance(_json_object(text), dict) if text.startswith("{") or kind == "dict" else True
    try:
        if kind == "int":
            int(text)
        elif kind == "float":
            float(text)
        elif kind == "bool":
            return text.lower() in _TRUE | _FALSE
    except ValueError:
        return False
    return True


def _json_object(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


# orch's own bounds where TRL and transformers accept a value that cannot train (a negative step count, a zero
# length) or fail only on the node: (lowest, highest, whether the lowest is allowed); the owners check the rest in
# the rehearsal. Every float must be finite: nan and inf pass every parser and poison the first step.
RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    **dict.fromkeys(("learning_rate", "beta", "weight_decay", "max_grad_norm", "warmup_steps", "seed",
                     "dataloader_num_workers", "label_smoothing_factor", "epsilon", "epsilon_high", "lora_dropout",
                     "top_k"), (0, None, True)),
    **dict.fromkeys(("max_length", "max_prompt_length", "max_completion_length", "max_seq_length",
                     "gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "num_generations", "lora_r", "save_total_limit", "num_iterations", "steps_per_generation"),
                    (1, None, True)),
    **dict.fromkeys(("logging_steps", "save_steps", "eval_steps", "num_train_epochs", "temperature", "lora_alpha",
                     "repetition_penalty"), (0, None, False)),
    # the sampler's own bounds, which transformers' logits processors and vLLM's SamplingParams check only when the
    # first completions are generated (GRPO, RLOO: after the model and the vLLM engine loaded)
    "warmup_ratio": (0, 1, True),
    "min_p": (0, 1, True),
    "top_p": (0, 1, False),
}  # fmt: skip


def out_of_range(key: str, kind: object, value: object) -> str:
    """Why a numeric TRL value cannot train ('' when it can, or when it is not a number)."""
    import math

    if kind not in ("int", "float") or value is None or isinstance(value, bool):
        return ""
    try:
        number = float(str(value).strip())
    except ValueError:
        return ""
    if not math.isfinite(number):
        return f"{key} must be a finite number"
    if key == "max_steps":
        return "" if number == -1 or number >= 1 else "max_steps takes -1 (train by epochs) or at least 1"
    low, high, inclusive = RANGES.get(key, (None, None, True))
    if low is not None and (number < low or (number == low and not inclusive)):
        return f"{key} must be {'at least' if inclusive else 'more than'} {low:g}"
    if high is not None and number > high:
        return f"{key} must be at most {high:g}"
    return ""


def unreported_metric(trainer: str, key: str, value: object) -> str:
    """Why metric_for_best_model cannot be found in the trainer's evaluations ('' when it can, or when the trainer
    names some metrics as it runs: GRPO's, RLOO's): transformers looks it up only at the first evaluation, a
    KeyError after the model loaded and trained eval_steps steps."""
    table = _schema().get("eval_metrics", {})
    if key != "metric_for_best_model" or value is None or table.get(trainer) is None:
        return ""
    reported = [*table.get("every", []), *table[trainer]]
    name = str(value).strip().removeprefix("eval_")
    if name in reported:
        return ""
    hint = did_you_mean(name, reported, cutoff=0.6)
    return (f"transformers looks it up only at the first evaluation, and the {trainer} trainer's evaluations report "
            f"{', '.join(reported)} (each also eval_-named); {hint}name one of them")


def _nearest(kind: object, value: object) -> str:
    """`did you mean X? ` for a mistyped choice (optim=adamw: adamw_torch), else ""."""
    if not isinstance(kind, list):
        return ""
    return did_you_mean(str(value).strip(), [str(c) for c in kind], cutoff=0.6, begins=True)


def _bool_spellings(trainer: str, key: str) -> dict[str, str]:
    """What a config's __post_init__ makes of a YAML true/false for a choice field (GRPO's scale_rewards: false is
    none); a command line's `--scale_rewards false` stays the text 'false', which the trainer refuses as it trains."""
    return _schema().get("bool_spellings", {}).get(trainer, {}).get(key, {})


def _said_bool(trainer: str, key: str, value: object) -> str:
    word = str(value).strip().lower()
    word = "true" if word in _TRUE else "false" if word in _FALSE else word
    if not (choice := _bool_spellings(trainer, key).get(word)):
        return ""
    return (f"on the command line TRL keeps {value} as text, which its trainer refuses at the first step (only a "
            f"YAML config's {key}: {word} means {choice}): write {key}={choice}; ")  # fmt: skip


def _said_list(key: str, kind: object, value: object) -> str:
    """How to write a list whose items are right but whose separators are not (`loss_type=sigmoid,ipo` or
    `[sigmoid, ipo]`: the node splits an override's words on spaces, so that was one unknown item)."""
    import re

    items = [item for item in re.split(r"[\s,\[\]'\"]+", str(value)) if item]
    if not isinstance(kind, dict) or not items or not _kind_ok(kind, " ".join(items)):
        return ""
    return f"separate the items with spaces and quote the whole for the shell: {key}='{' '.join(items)}'; "


def _describe(kind: object) -> str:
    if isinstance(kind, dict):
        return f"a list of {', '.join(map(str, kind['list']))}"
    if isinstance(kind, list):
        return f"one of {', '.join(map(str, kind))}"
    json_object = """a JSON object, keys and strings in double quotes ('{"key": 1}': quote it whole for the shell)"""
    one_word = ("one value on the command line, where TRL's parser reads one word (several go as a YAML list in the "
                "TRL config file)")
    config_list = ("a YAML list in the TRL config file (for example [-1.0, 1.0]): TRL's parser makes a tuple of a "
                   "command line's characters")
    described = {"int": "an integer", "float": "a number", "bool": "true or false", "dict": json_object,
                 "str|list": one_word, "config list": config_list,
                 "dict|file": f"{json_object} or a JSON file's path"}  # fmt: skip
    return described.get(str(kind), f"a {kind}")


def check(trainer: str, overrides: Mapping[str, str], source: str = "override") -> None:
    """Unknown names and values of the wrong type are one-line errors with a suggestion."""
    known = fields(trainer)
    for key, value in overrides.items():
        if key in SECRET_ARGUMENTS:
            raise OrchError(
                f"{source} {key}=...: a token in a TRL argument is written to sky_jobs/ and the nodes' argv; pass "
                f"--secret {SECRET_ARGUMENTS[key]} instead (the Hub libraries read it from the environment)"
            )
        if key not in known:
            hint = did_you_mean(key, known, cutoff=0.6)
            raise OrchError(
                f"{source} {key}={value}: {trainer} has no TRL argument {key!r}; {hint}"
                f"`trl {trainer} --help` lists them ({_stack()})"
            )
        if not _kind_ok(known[key], str(value)):
            said = _said_bool(trainer, key, value) or _said_list(key, known[key], value) or _nearest(known[key], value)
            raise OrchError(f"{source} {key}={value}: {said}{key} takes {_describe(known[key])}")
        if why := out_of_range(key, known[key], value) or unreported_metric(trainer, key, value):
            raise OrchError(f"{source} {key}={value}: {why}")


def _value_ok(kind: object, value: object) -> bool:
    """A TRL config file's value (as YAML typed it) fits the argument's kind."""
    if value is None or kind in ("str", "list", "str|list"):
        return True
    if kind == "config list":
        return isinstance(value, (list, tuple))
    if kind in ("dict", "dict|file") and isinstance(value, dict):
        return True
    if isinstance(kind, dict):  # a list whose items have choices
        return _kind_ok(kind, value)
    if isinstance(value, (list, dict)):
        return False
    return _kind_ok(kind, str(value))


def check_config_env(env: object, path: str) -> None:
    """A TRL config's `env:` block, which TrlParser exports inside every training process as it parses (after
    `accelerate launch` and orch's node read theirs): a credential there travels with the workdir to every node;
    an ORCH_ knob there is never seen by orch; a per-process variable (CUDA_VISIBLE_DEVICES: '0' put every rank on
    GPU 0) or an ACCELERATE_ one overrides what accelerate gave each process."""
    from orchestrator.core import credentials, knobs

    if not isinstance(env, Mapping):
        raise OrchError(f"TRL config {path}: env: {env!r}: TRL takes a mapping of variable names to values")
    for name, value in env.items():
        name = str(name)
        if why := credentials.looks_secret(name, str(value)):
            raise OrchError(f"TRL config {path}: env.{name}: {why}, and the file travels with the workdir to every "
                            f"node; delete it, declare it in the recipe's `secrets:` as `{name}: null` and pass "
                            f"--secret {name} (never written)")  # fmt: skip
        if name.startswith("ORCH_"):
            raise OrchError(f"TRL config {path}: env.{name}: TRL sets its env inside the training processes, "
                            f"where orch never reads it; put {name} in the recipe's envs or pass --env "
                            f"{name}=...")  # fmt: skip
        if why := knobs.set_by_launchers(name, in_process=True):
            raise OrchError(f"TRL config {path}: env.{name}: TRL would set it inside every rank, and {why}; delete "
                            "it")  # fmt: skip


def check_config_keys(trainer: str, config: Mapping, path: str) -> None:
    """Keys of a TRL config file exist for its trainer, and their values fit TRL's types and choices (what TRL's
    parser would refuse on the node, and DPO's loss_type that TRL checks only at the first step)."""
    known = fields(trainer)
    if "env" in config:
        check_config_env(config["env"], path)
    for key, value in config.items():
        if key not in known and key not in CONFIG_ONLY_KEYS:
            hint = did_you_mean(str(key), known, cutoff=0.6)
            raise OrchError(f"TRL config {path}: {trainer} has no argument {key!r}; {hint}`trl {trainer} --help` lists "
                            f"them ({_stack()})")  # fmt: skip
        if key in SECRET_ARGUMENTS and value:
            raise OrchError(
                f"TRL config {path}: {key} holds a credential that would travel in files and argv; delete it and "
                f"pass --secret {SECRET_ARGUMENTS[key]}"
            )
        spelled = isinstance(value, bool) and str(value).lower() in _bool_spellings(trainer, str(key))
        if key in known and not spelled and not _value_ok(known[key], value):
            kind = known[key]
            choices = {str(c) for c in kind} if isinstance(kind, list) else set()
            yaml_bool = isinstance(value, bool) and bool({"no", "yes"} & choices)
            word = "yes" if value else "no"
            said = f' (YAML reads an unquoted no or yes as false or true: write "{word}")' if yaml_bool else ""
            raise OrchError(f"TRL config {path}: {key}: {value!r}{said}: {_nearest(known[key], value)}{key} takes "
                            f"{_describe(known[key])}")  # fmt: skip
        why = key in known and (out_of_range(str(key), known[key], value) or unreported_metric(trainer, key, value))
        if why:
            raise OrchError(f"TRL config {path}: {key}: {value!r}: {why}")


def is_list(trainer: str, key: str) -> bool:
    kind = fields(trainer).get(key)
    return kind == "list" or isinstance(kind, dict)


def render(schema: dict) -> str:
    lines = ["{"]
    for i, (trainer, names) in enumerate(schema.items()):
        lines.append(f"  {json.dumps(trainer)}: {{")
        items = list(names.items())
        for j, (name, kind) in enumerate(items):
            lines.append(f"    {json.dumps(name)}: {json.dumps(kind)}" + ("," if j < len(items) - 1 else ""))
        lines.append("  }" + ("," if i < len(schema) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"
