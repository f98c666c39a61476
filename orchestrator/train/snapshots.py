"""Snapshots of the training stack for the launch side, which never imports it: `python -m orchestrator.train.snapshots`
(or `make snapshots`) regenerates both and tests fail when they drift from the installed versions.

- core/trl_args.json: each TRL trainer's arguments (from TRL's own parsers, with the choices its trainer checks only
  as it trains, read from the trainer's source), TRL's Accelerate profiles, the trl / transformers / accelerate
  versions;
- core/accelerate_args.json: what `accelerate launch` reads from a config (ClusterConfig, the launch parser,
  the env builders of accelerate.utils.launch).
- core/torch_cuda.json: torch's own tables of its release's CUDA builds (the compute capabilities each has kernels
  for) and of the devices each kernel runs on, with the CUDA of uv.lock's torch (core/cuda_arch.py).
(core/sky_task_schema.json, SkyPilot's task schema, comes from launch/backends/sky.py: the only module importing sky.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from orchestrator.core import accelerate_schema, cuda_arch, trl_schema


def _kind(tp) -> object:
    import enum
    import types
    import typing

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        kinds = [_kind(a) for a in args]
        if "list" in kinds:
            return "list"
        for preferred in ("bool", "int", "float"):
            if kinds == [preferred]:
                return preferred
        choices = [k for k in kinds if isinstance(k, list)]
        if len(kinds) == 1 and choices:
            return choices[0] + [None]
        return "str"
    if origin is typing.Literal:
        return list(typing.get_args(tp))
    if origin in (list, tuple) or tp in (list, tuple):
        return "list"
    if origin is dict or tp is dict:
        return "str"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m.value for m in tp]
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    return "str"


_VALUES = re.compile(r"(?:(?:Possible|Supported|Valid) (?:values|options) are:?|Must be one of)\s*(.+?)\.(?:\s|$)")
_QUOTED = r"`'([A-Za-z0-9_.-]+)'`|'([A-Za-z0-9_.-]+)'|`([A-Za-z0-9_.-]+)`"


def help_choices(help_text: str) -> list[str]:
    """The values a field's help lists ("Possible values are: `'sigmoid'`, `'hinge'` ...", "Must be one of `'server'`
    or `'colocate'`"): TRL checks some of them only at the first loss computation (DPO's loss_type) or only where
    vLLM runs (vllm_mode), so the launch side needs the list."""
    match = _VALUES.search(help_text or "")
    if not match:
        return []
    segment = match.group(1)
    rest = re.sub(_QUOTED + r"|\band\b|\bor\b|[\s,]", "", segment)
    found = ["".join(groups) for groups in re.findall(_QUOTED, segment)]
    return found if not rest else []  # a plain list, nothing else


def _compared(test) -> tuple[str, list[str]] | None:
    """(attribute, values) of `x.attr == "v"`, `x.attr in ("v", "w")` or an `or` of them; None for anything else."""
    import ast

    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        parts = [_compared(value) for value in test.values]
        found = [part for part in parts if part is not None]
        if len(found) == len(parts) and len({name for name, _ in found}) == 1:
            return found[0][0], [v for _, values in found for v in values]
        return None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Attribute)):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return test.left.attr, [right.value]
    if isinstance(op, ast.In) and isinstance(right, (ast.List, ast.Tuple, ast.Set)):
        values = [e.value for e in right.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(values) == len(right.elts):
            return test.left.attr, values
    return None


def raised_choices(source: str) -> dict[str, list[str]]:
    """The values a trainer's own `if x.attr == "a": ... elif x.attr in ("b", "c"): ... else: raise` chains take,
    per attribute: TRL checks GRPO's importance_sampling_level, scale_rewards, multi_objective_aggregation and DPO's
    f_divergence_type this way only as it trains (after the model loaded, for GRPO after the first generation), so a
    mistyped value reached the nodes. A field in several such chains takes what every chain takes."""
    import ast

    out: dict[str, list[str]] = {}
    ifs = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.If)]
    elifs = {id(node.orelse[0]) for node in ifs if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)}
    for node in ifs:
        if id(node) in elifs:  # a chain is read from its first `if`
            continue
        tests, last = [node.test], node
        while len(last.orelse) == 1 and isinstance(last.orelse[0], ast.If):
            last = last.orelse[0]
            tests.append(last.test)
        compared = [found for test in tests if (found := _compared(test)) is not None]
        if len(tests) < 2 or not (last.orelse and isinstance(last.orelse[-1], ast.Raise)) or len(compared) < len(tests):
            continue
        names = {name for name, _ in compared}
        if len(names) == 1:
            name, values = names.pop(), [v for _, vs in compared for v in vs]
            out[name] = [v for v in out.get(name, values) if v in values]
    return out


def bool_spellings(config: type, name: str, choices: list) -> dict[str, str]:
    """The choice a config's __post_init__ makes of a YAML true/false for a field (GRPO's scale_rewards: false means
    none). Only a config file gives a bool: on the command line `--scale_rewards false` stays the text 'false'."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for value in (True, False):
            try:
                made = getattr(config(output_dir=scratch, use_cpu=True, bf16=False, **{name: value}), name)
            except Exception:  # noqa: BLE001 - the config refuses a bool: no spelling to record
                continue
            if made in choices:
                out[str(value).lower()] = made
    return out


def trainer_scripts() -> list[str]:
    """Every training script TRL ships (trl.scripts.<name> whose parser builds TrainingArguments), whether or not orch's
    registry (core/trainers.py) runs it yet: a trainer added there finds its arguments here."""
    import importlib
    import pkgutil

    import trl.scripts
    from transformers import TrainingArguments

    names = []
    for info in pkgutil.iter_modules(trl.scripts.__path__):
        module = importlib.import_module(f"trl.scripts.{info.name}")
        make = getattr(module, "make_parser", None)
        if make and any(isinstance(t, type) and issubclass(t, TrainingArguments) for t in make().dataclass_types):
            names.append(info.name)
    return sorted(names)


def _splits_characters(convert) -> bool:
    """The parser's conversion of a word makes a tuple of its characters (`tuple`, wrapped to accept None)."""
    try:
        return callable(convert) and convert("ab") == ("a", "b")
    except Exception:  # noqa: BLE001 - a conversion that refuses "ab" keeps its text
        return False


def _trainer_source(config: type) -> str:
    """The source of the trainer a TRL config belongs to (trl/trainer/grpo_config.py: grpo_trainer.py), or ''."""
    import importlib
    import inspect

    module = config.__module__
    if not module.startswith("trl.") or not module.endswith("_config"):
        return ""
    try:
        return inspect.getsource(importlib.import_module(module.removesuffix("_config") + "_trainer"))
    except ImportError:
        return ""


def trainer_metrics(source: str) -> list[str] | None:
    """The names a TRL trainer adds to an evaluation's metrics, from its `self._metrics[mode]["name"]` writes (its
    log() puts them in, eval_-named); None where one is named as it runs (GRPO's rewards/{reward_func}/mean and the
    reward functions' log_metric): any name may be reported there. Not `self._metrics["train"][...]`."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        inner = node.value if isinstance(node, ast.Subscript) else None
        if not (isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Attribute)
                and inner.value.attr == "_metrics"):  # fmt: skip
            continue
        if isinstance(inner.slice, ast.Constant) and inner.slice.value == "train":
            continue
        if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            return None
        names.add(node.slice.value)
    return sorted(names)


def evaluation_metrics() -> list[str]:
    """The names transformers' own evaluation reports (`f"{metric_key_prefix}_loss"` in trainer.py, speed_metrics'
    `f"{split}_runtime"`...), which metric_for_best_model may name with or without its eval_ prefix."""
    import ast
    import inspect

    import transformers.trainer
    import transformers.trainer_utils

    out = set()
    for module in (transformers.trainer, transformers.trainer_utils):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.JoinedStr) and len(node.values) == 2:
                head, tail = node.values
                if (isinstance(head, ast.FormattedValue) and isinstance(head.value, ast.Name)
                        and head.value.id in ("metric_key_prefix", "split") and isinstance(tail, ast.Constant)
                        and str(tail.value).startswith("_") and len(tail.value) > 1):  # fmt: skip
                    out.add(tail.value[1:])
    return sorted(out)


def generate_trl() -> dict[str, dict[str, object]]:
    import dataclasses
    import importlib
    import importlib.metadata
    import typing

    out: dict[str, dict[str, object]] = {
        "versions": {p: importlib.metadata.version(p) for p in ("trl", "transformers", "accelerate")}
    }
    spellings: dict[str, dict[str, dict[str, str]]] = {}
    metrics: dict[str, list[str] | None] = {}
    import torch._inductor

    # torch.compile checks its mode when accelerate compiles the model, in train(): after the model loaded
    compile_modes = {"torch_compile_mode": list(torch._inductor.list_mode_options())}
    for trainer in trainer_scripts():
        parser = importlib.import_module(f"trl.scripts.{trainer}").make_parser()
        # the choices the parser itself enforces (HfArgumentParser makes them from an Enum in a Union with str too:
        # optim, lr_scheduler_type, save_strategy...), which the type hints alone give as a str
        enforced = {a.dest: [str(getattr(c, "value", c)) for c in a.choices] for a in parser._actions if a.choices}
        # and the bools it makes of a union of str and bool (include_num_input_tokens_seen: its help's `all` is refused
        # by the parser, from the command line and a config file alike)
        as_bool = {a.dest for a in parser._actions if getattr(a.type, "__name__", "") == "string_to_bool"}
        # and the one word it takes for a union of str and list (report_to, optim_target_modules: `--report_to a b`
        # was "Some specified arguments are not used"), where a config file may give a list
        one_word = {a.dest for a in parser._actions if a.nargs not in ("+", "*")}
        # a tuple the parser makes of the text's characters (RLOO's reward_clip_range: '(-1,1)' clamped by '(' and
        # '-' at the first step): a config file's YAML list only
        characters = {a.dest for a in parser._actions if _splits_characters(a.type)}
        names: dict[str, object] = {}
        for dtype in parser.dataclass_types:
            hints = typing.get_type_hints(dtype)
            source = _trainer_source(dtype)
            checked = {**(raised_choices(source) if source else {}), **compile_modes}
            if source:
                metrics[trainer] = trainer_metrics(source)
            for f in dataclasses.fields(dtype):
                if f.init:
                    kind = "bool" if f.name in as_bool else _kind(hints.get(f.name, str))
                    if kind == "list" and f.name in one_word:
                        kind = "config list" if f.name in characters else "str|list"
                    choices = ((f.metadata or {}).get("choices") or enforced.get(f.name)
                               or help_choices((f.metadata or {}).get("help", "")))  # fmt: skip
                    if choices and kind == "str":
                        kind = list(choices)
                    elif choices and kind == "list":
                        kind = {"list": list(choices)}
                    if kind == "str" and f.name in checked:
                        kind = checked[f.name]
                        if spelled := bool_spellings(dtype, f.name, kind):
                            spellings.setdefault(trainer, {})[f.name] = spelled
                    if kind == "str" and f.name in getattr(dtype, "_VALID_DICT_FIELDS", ()):
                        # the config's __post_init__ reads a value that starts with { as JSON; some take a file too
                        file = "path to a json" in str((f.metadata or {}).get("help", "")).lower()
                        kind = "dict|file" if file else "dict"
                    names[f.name] = kind
        out[trainer] = dict(sorted(names.items()))
    out["bool_spellings"] = {trainer: dict(fields) for trainer, fields in spellings.items()}
    # what metric_for_best_model may name: transformers looks it up only at the first evaluation (a KeyError then)
    out["eval_metrics"] = {"every": evaluation_metrics(), **metrics}
    import yaml

    folder = Path(importlib.import_module("trl").__file__).parent / "accelerate_configs"
    out["profiles"] = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}
    return out


def generate_accelerate() -> dict:
    import dataclasses
    import importlib.metadata
    import inspect
    import re

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import constants
    from accelerate.utils import launch as launch_utils

    actions = launch_command_parser()._actions
    dests = {action.dest for action in actions if action.dest != "help"}
    # the values accelerate takes: its parser's choices (a config file's values skip them), and the FSDP names its
    # plugin looks up in torch's enums (a name not there was `KeyError: 'SHARDED'` in the trainer's constructor)
    choices = {a.dest: [str(c) for c in a.choices] for a in actions if a.choices}
    for name in accelerate_schema.ENUMS:  # fsdp_state_dict_type: constants.FSDP_STATE_DICT_TYPE
        choices[name] = list(getattr(constants, name.upper()))
    import torch._inductor

    # a config's dynamo_mode skips the parser's three and reaches torch.compile, which takes its own modes
    choices["dynamo_mode"] = list(torch._inductor.list_mode_options())
    from accelerate.utils import DistributedType

    # a config file's distributed_type is DistributedType(value), exact: `fsdp` stops `accelerate launch` on every node
    choices["distributed_type"] = [t.value for t in DistributedType]
    # Attributes the env builders read that are no parser option (e.g. fsdp_ignored_modules from a config file).
    source = inspect.getsource(launch_utils)
    read = set(re.findall(r"\bargs\.([a-z_][a-z0-9_]*)", source))
    read |= set(re.findall(r"getattr\(args, \"([a-z_][a-z0-9_]*)\"", source))
    return {
        "versions": {"accelerate": importlib.metadata.version("accelerate")},
        "config_fields": sorted(f.name for f in dataclasses.fields(ClusterConfig)),
        "launch_arguments": sorted(dests | read),
        "choices": dict(sorted(choices.items())),
    }


def lock_cuda(lock: Path) -> str:
    """The CUDA of uv.lock's torch build: its cuda-toolkit dependency's version, major.minor (13.0.3.0 -> 13.0)."""
    import tomllib

    packages = {p["name"]: p for p in tomllib.loads(lock.read_text())["package"]}
    needs = {d["name"] for d in packages["torch"].get("dependencies", [])}
    if "cuda-toolkit" not in needs:
        raise SystemExit(f"{lock}: its torch does not depend on cuda-toolkit; say how to read its CUDA build here")
    return ".".join(packages["cuda-toolkit"]["version"].split(".")[:2])


LOCK = Path(__file__).resolve().parents[2] / "uv.lock"


def generate_torch_cuda(lock: Path = LOCK) -> dict:
    import torch
    import torch.cuda as cuda

    runs: dict[str, dict] = {}
    for code, rule in cuda.DEVICE_REQUIREMENT.items():
        if hasattr(rule, "values"):  # torch's _CompatSet
            runs[str(code)] = {"only": sorted(rule.values)}
        else:  # _CompatInterval: the same major, a minor at least start's, but the excluded
            runs[str(code)] = {"start": 10 * rule.major + rule.minor, "exclude": sorted(rule.exclude)}
    return {
        "torch": torch.__version__.split("+")[0],
        "lock_cuda": lock_cuda(lock),
        "builds": {version: {host: sorted(codes) for host, codes in hosts.items()}
                   for version, hosts in cuda.PYTORCH_RELEASES_CODE_CC.items()},  # fmt: skip
        "runs": runs,
    }


def render_torch_cuda(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main() -> None:
    for path, text in (
        (trl_schema.SCHEMA, trl_schema.render(generate_trl())),
        (accelerate_schema.SCHEMA, accelerate_schema.render(generate_accelerate())),
        (cuda_arch.SNAPSHOT, render_torch_cuda(generate_torch_cuda())),
    ):
        Path(path).write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
