"""The trainer registry (core/trainers.py): each spec against TRL's own classes, scripts and defaults, and the rule
that no other module decides anything by a trainer's name."""

import ast
import dataclasses
import importlib
import inspect

import pytest
from conftest import ROOT

from orchestrator.core import trainers, trl_schema
from orchestrator.core.trainers import SPECS

pytestmark = pytest.mark.unit

PACKAGE = ROOT / "orchestrator"


def _config_defaults(name: str) -> tuple[dict, set]:
    """TRL's own parser for a trainer: its TrainingArguments subclass's defaults, and every argument it takes."""
    from transformers import TrainingArguments

    parser = importlib.import_module(f"trl.scripts.{name}").make_parser()
    config = next(t for t in parser.dataclass_types if issubclass(t, TrainingArguments))
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    arguments = {f.name for t in parser.dataclass_types for f in dataclasses.fields(t)}
    return defaults, arguments


@pytest.mark.parametrize("name", list(SPECS))
def test_each_spec_agrees_with_trls_class_script_and_defaults(name):
    import trl
    from transformers import Trainer

    spec = SPECS[name]
    assert issubclass(getattr(trl, spec.trl_class), Trainer)
    defaults, arguments = _config_defaults(name)
    assert set(trl_schema.fields(name)) == arguments  # the launch side's snapshot of the same parser
    if spec.generates:
        assert defaults["num_generations"] == spec.generations_default
        assert {"reward_funcs", "use_vllm", "max_completion_length"} <= arguments
        assert "max_prompt_length" not in arguments  # prompts go in whole: core/fit.PROMPT_TOKENS stands for them
    else:
        assert "num_generations" not in arguments
    if spec.reference == "beta":
        assert defaults["beta"] == spec.beta_default
    assert spec.format in trainers.FORMATS
    assert all(set(spec.example) >= set(columns) for columns in spec.columns[:1])  # the example has the columns
    assert set(spec.smoke_overrides) <= arguments
    # the memory model counts TRL's fused LM head (core/memory.lm_head) for the trainers that add one
    assert ("add_fused_lm_head(" in inspect.getsource(getattr(trl, spec.trl_class))) == spec.fused_head


def test_reference_models_follow_the_spec():
    grpo, dpo, sft = SPECS["grpo"], SPECS["dpo"], SPECS["sft"]
    assert not grpo.has_reference({}) and grpo.has_reference({"beta": "0.04"}) and not grpo.has_reference({"beta": 0})
    assert dpo.has_reference({}) and not dpo.has_reference({}, peft=True)
    assert not sft.has_reference({"beta": 1})


def _names_a_trainer(tree: ast.AST) -> list[str]:
    """Decisions by a trainer's name: a comparison with one, membership in a literal holding one, a dict keyed by
    one, a subscript with one."""
    names = set(SPECS)
    found = []

    def literal(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in node.elts)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(literal(p) for p in [node.left, *node.comparators]):
            found.append(f"line {node.lineno}: compares with a trainer's name")
        if isinstance(node, ast.Dict) and any(k is not None and literal(k) for k in node.keys):
            found.append(f"line {node.lineno}: a dict keyed by trainer names")
        if isinstance(node, ast.Subscript) and literal(node.slice):
            found.append(f"line {node.lineno}: indexed by a trainer's name")
    return found


def test_no_module_but_the_registry_decides_by_a_trainers_name():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "core" / "trainers.py":
            continue
        bad += [(path.relative_to(PACKAGE).as_posix(), why) for why in _names_a_trainer(ast.parse(path.read_text()))]
    assert not bad, bad
    planted = 'if trainer == "grpo":\n    pass\nx = {"dpo": 2}\ny = trainer in ("kto", "x")\nz = table["sft"]\n'
    assert len(_names_a_trainer(ast.parse(planted))) == 4


def test_the_recipes_reward_functions_run_in_the_environment_the_nodes_install():
    """Every reward function a recipe names, resolved as the training entry resolves it and called on a sample, in
    this environment (uv.lock's, as the nodes install it): TRL's accuracy reward needs math-verify."""
    from orchestrator.core import yamlio
    from orchestrator.train.entry import _reward_funcs

    named = set()
    for path in sorted((ROOT / "recipes" / "trl").glob("*.yaml")):
        named |= set(yamlio.load(path.read_text()).get("reward_funcs") or [])
    assert named, "no recipe names a reward function"
    completions = [[{"role": "assistant", "content": "2 + 2 = \\boxed{4}"}], [{"role": "assistant", "content": "5"}]]
    for func in _reward_funcs(sorted(named)):
        rewards = func(completions=completions, solution=["4", "4"], prompts=[[], []])
        assert len(rewards) == 2 and rewards[0] > (rewards[1] or 0), (func.__name__, rewards)


def test_headline_metrics_pick_the_trainers_keys_in_order_and_one_reward_function_per_star():
    record = {"loss": 0.5, "reward": 0.25, "rewards/acc/mean": 0.0, "rewards/acc/std": 0.1, "rewards/a/b/mean": 9.0,
              "rewards/fmt/mean": 1, "kl": True, "rewards/accuracies": 0.75}  # fmt: skip
    assert SPECS["grpo"].headline(record) == [("reward", 0.25), ("rewards/acc/mean", 0.0), ("rewards/fmt/mean", 1.0)]
    assert SPECS["dpo"].headline(record) == [("rewards/accuracies", 0.75)]  # no margins logged: nothing made up
    assert SPECS["kto"].headline(record) == []  # a bool is not a figure
    assert all(spec.metrics for spec in SPECS.values())


def test_orch_status_shows_the_trainers_first_measure_from_a_log_or_a_step_line(tmp_path):
    """`orch status`'s METRIC column (launch/progress.py): from a local run's log.jsonl through the trainer's spec,
    from a cloud run's step line as the node printed it; a log of an orch that named no trainer shows none."""
    import json

    from orchestrator.launch import progress

    line = {"step": 3, "loss": 0.0, "grad_norm": 0.1, "reward": 0.8125, "rewards/digit/mean": 0.5, "max_steps": 8}
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({**line, "trainer": "grpo"}) + "\n" + json.dumps({"step": 3, "train_runtime": 9}) + "\n")
    assert progress.from_log(log) == {"step": "3/8", "loss": "0", "metric": "reward=0.8125"}
    log.write_text(json.dumps(line) + "\n")
    assert "metric" not in progress.from_log(log)
    printed = "(head, rank=0, pid=9) [orch] step 3/8 loss=0 learning_rate=5e-07 grad_norm=0.1 reward=0.8125 " \
              "rewards/digit/mean=0.5 | 41 tok/s | elapsed 0m09s | ETA 0m15s"  # fmt: skip
    assert progress.from_lines(printed)["metric"] == "reward=0.8125"
    assert "metric" not in progress.from_lines("[orch] step 3/8 loss=0.5 learning_rate=5e-07 | 41 tok/s")


def test_the_rows_trl_drops_are_named_by_each_trainers_rule_and_only_where_rows_are_counted():
    """train/kept.py: TRL's own rule for the rows it leaves out, per trainer, with the run's settings; nothing said
    where the split is streamed (no length), where SFT packs rows into sequences, or where nothing was left out."""
    from types import SimpleNamespace

    from orchestrator.train import kept

    args = SimpleNamespace(max_length=512, truncation_mode="keep_end", packing=False)
    sft = kept.judge("sft", 10, 7, args)
    assert kept.line("sft", sft) == (
        "[orch] data: TRL's sft trainer kept 7 of 10 training rows (3 left out, 30%): it drops each row left with no "
        "token to learn from once cut to max_length=512 (truncation_mode=keep_end: a prompt or other turns that fill "
        "it, or no completion)"
    )
    assert kept.judge("reward", 4, 1, args)["why"] == "each pair whose chosen or rejected is longer than max_length=512"
    assert kept.judge("grpo", 4, 3, args)["why"] == "rows it cannot use"  # no rule known: said as such
    assert kept.line("dpo", kept.judge("dpo", 5, 5, args)) is None
    assert kept.judge("sft", 10, 3, SimpleNamespace(max_length=64, packing=True)) is None
    assert kept.judge("dpo", None, 3, args) is None and kept.judge("dpo", 3, None, args) is None
    with pytest.raises(ValueError, match=r"^TRL's kto trainer kept none of the 1,200 training rows: it drops each row "
                                         r"whose prompt alone fills max_length=512; raise max_length"):  # fmt: skip
        kept.judge("kto", 1200, 0, args)
    assert kept.count(iter([])) is None and kept.count([1, 2]) == 2


def test_a_split_the_dataset_lacks_is_named_with_the_setting_and_the_splits_it_has():
    """TRL's scripts index the loaded dataset by dataset_train_split / dataset_test_split: a missing one stopped the
    ranks on `KeyError: 'validation'`; train/entry.split names the setting, the splits there are and the fix."""
    from datasets import Dataset, DatasetDict

    from orchestrator.train import entry

    loaded = DatasetDict({"train": Dataset.from_dict({"text": ["a"]}), "test": Dataset.from_dict({"text": ["b"]})})
    assert entry.split(loaded, "test", "dataset_test_split")["text"] == ["b"]
    said = r"^dataset_train_split=validation: the dataset has no such split \(its splits: train, test\); set "
    with pytest.raises(ValueError, match=said + "dataset_train_split to one of them$"):
        entry.split(loaded, "validation", "dataset_train_split")
