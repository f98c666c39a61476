"""Every file under recipes/ is checked by its own tool: SkyPilot's task schema, accelerate's config loader,
the trainer's TRL argument parser. Walks recipes/ recursively; a YAML that none of them claims fails."""

import importlib
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, orch

from orchestrator.core import overrides, trainers
from orchestrator.core.configs import PROFILES, resolve_accelerate_config
from orchestrator.launch import recipe as recipes

pytestmark = pytest.mark.cli

RECIPES_DIR = ROOT / "recipes"
ALL_YAML = sorted(RECIPES_DIR.rglob("*.yaml"))
TASKS = [p for p in ALL_YAML if p.parent == RECIPES_DIR]
ACCELERATE = [p for p in ALL_YAML if p.parent.name == "accelerate"]
TRL = [p for p in ALL_YAML if p.parent.name == "trl"]


def load_task(path: Path) -> recipes.Recipe:
    return recipes.load(str(path))


def users_of(config: Path, key: str) -> list[recipes.Recipe]:
    rel = config.relative_to(ROOT).as_posix()
    return [r for r in map(load_task, TASKS) if r.envs[key] == rel]


def test_every_yaml_is_claimed():
    assert TASKS and ACCELERATE and TRL
    assert set(ALL_YAML) == set(TASKS) | set(ACCELERATE) | set(TRL)


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_skypilot_accepts_recipe(path):
    import sky
    task = sky.Task.from_yaml(str(path))
    assert task.run and "orch node" in task.run
    assert task.num_nodes >= 1


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_recipe_header_shows_its_commands(path):
    head = path.read_text().split("\nname:")[0]
    assert "sky launch" in head and f"recipes/{path.name}" in head
    assert f"orch run {path.stem}" in head and "--smoke" in head


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_paired_files_exist(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = load_task(path)
    recipes.check_paired_files(recipe)
    assert recipe.trainer in trainers.SPECS


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_loads_config(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.distributed_type in ("FSDP", "DEEPSPEED", "MULTI_GPU")
    assert users_of(path, "ACCELERATE_CONFIG"), f"{path} is used by no recipe"


@pytest.mark.parametrize(
    "profile", sorted({r.envs["ACCELERATE_CONFIG"] for r in map(load_task, TASKS)} & set(PROFILES))
)
def test_accelerate_loads_profiles_recipes_name(profile):
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(resolve_accelerate_config(profile))).num_processes >= 1


def _parse(trainer: str, config: Path, recipe_overrides: str):
    parser = importlib.import_module(f"trl.scripts.{trainer}").make_parser()
    argv = ["--config", str(config), *overrides.to_argv(overrides.loads(recipe_overrides), trainer)]
    # TrainingArguments refuses bf16 without a GPU unless told it runs on CPU: that flag is all we add.
    return parser.parse_args_and_config(args=[*argv, "--use_cpu", "true"])


@pytest.mark.parametrize("path", TRL, ids=lambda p: p.stem)
def test_trl_parser_accepts_config_with_each_recipes_overrides(path):
    users = users_of(path, "TRL_CONFIG")
    assert users, f"{path} is used by no recipe"
    for recipe in users:
        script_args, training_args, model_args, _ = _parse(recipe.trainer, path, recipe.envs.get("TRL_OVERRIDES", ""))
        assert model_args.model_name_or_path and script_args.dataset_name
        assert training_args.output_dir.startswith("outputs/")


def test_trl_argument_list_matches_installed_trl():
    from orchestrator.core import trl_schema
    from orchestrator.train import snapshots

    assert trl_schema.SCHEMA.read_text() == trl_schema.render(snapshots.generate_trl()), (
        "orchestrator/core/trl_args.json is stale: run `make snapshots` and commit it"
    )


def test_the_values_a_trainer_checks_only_as_it_trains_are_read_from_its_if_elif_raise_chains():
    """TRL compares some string arguments only in its loss or its reward scaling (GRPO's importance_sampling_level,
    DPO's f_divergence_type): `if x.a == "p": ... elif x.a in ("q", "r"): ... else: raise` gives p, q, r. A chain with
    no raise, a chain over two attributes and a conditional check (`if x.a not in ...: raise`) give nothing; an
    `elif` is not read again as a chain of its own; two chains over one attribute give what both take."""
    from orchestrator.train.snapshots import raised_choices

    source = """
def loss(self):
    if self.level == "token":
        pass
    elif self.level == "sequence" or self.level == "group":
        pass
    elif self.level in ("seq", "tok"):
        pass
    else:
        raise ValueError(self.level)
    if self.level in ["token", "sequence", "group"]:
        pass
    elif self.level == "x":
        pass
    else:
        raise ValueError("twice")
    if self.mode == "a":
        pass
    elif self.mode == "b":
        pass
    if self.mixed == "a":
        pass
    elif self.other == "b":
        pass
    else:
        raise ValueError()
    if self.once not in ["a", "b"]:
        raise ValueError()
"""
    assert raised_choices(source) == {"level": ["token", "sequence", "group"]}


def test_metric_for_best_model_names_a_metric_the_trainers_evaluations_report():
    """transformers looks metric_for_best_model up only at the first evaluation (a KeyError after eval_steps steps:
    measured on a smoke run). The names are its own (eval_loss, the speed metrics) and the trainer's
    `self._metrics[mode]["name"]` writes; GRPO's and RLOO's reward functions name theirs as they run: any is taken.
    tests/test_trainers_smoke.py compares the names with what a real evaluation reported."""
    from orchestrator.core import trl_schema
    from orchestrator.core.errors import OrchError
    from orchestrator.train.snapshots import trainer_metrics

    source = """
def loss(self, mode):
    self._metrics[mode]["entropy"].append(1)
    self._metrics["eval"]["kl"].append(self._metrics[mode]["entropy"][-1])
    self._metrics["train"]["step_time"].append(2)
"""
    assert trainer_metrics(source) == ["entropy", "kl"]
    assert trainer_metrics(source + '    self._metrics[mode][f"rewards/{name}/mean"].append(3)\n') is None
    for value in ("loss", "eval_loss", "mean_token_accuracy", "eval_entropy", "runtime"):
        trl_schema.check("sft", {"metric_for_best_model": value})
    trl_schema.check_config_keys("dpo", {"metric_for_best_model": "rewards/accuracies"}, "c.yaml")
    trl_schema.check("grpo", {"metric_for_best_model": "rewards/my_reward/mean"})
    with pytest.raises(OrchError, match=r"metric_for_best_model=mean_token_acuracy: transformers looks it up only at "
                       r"the first evaluation, and the sft trainer's evaluations report loss, .*mean_token_accuracy, "
                       r".*did you mean mean_token_accuracy\? name one of them$"):  # fmt: skip
        trl_schema.check("sft", {"metric_for_best_model": "mean_token_acuracy"})
    with pytest.raises(OrchError, match=r"metric_for_best_model: 'eval_accuracy': .* the dpo trainer's evaluations "):
        trl_schema.check_config_keys("dpo", {"metric_for_best_model": "eval_accuracy"}, "c.yaml")


def test_a_choice_trl_maps_from_a_yaml_bool_is_taken_from_a_config_and_named_on_the_command_line():
    """GRPOConfig's __post_init__ turns scale_rewards: false into none; the command line's `--scale_rewards false`
    stays the text 'false', which the trainer refuses at its first step (measured with TRL's own parser)."""
    from orchestrator.core import trl_schema
    from orchestrator.core.errors import OrchError

    trl_schema.check_config_keys("grpo", {"scale_rewards": False, "importance_sampling_level": "sequence"}, "c.yaml")
    with pytest.raises(OrchError, match=r"scale_rewards: 'maybe': scale_rewards takes one of group, none, batch"):
        trl_schema.check_config_keys("grpo", {"scale_rewards": "maybe"}, "c.yaml")
    trl_schema.check("grpo", {"scale_rewards": "none", "vllm_mode": "server"})
    with pytest.raises(OrchError, match=r"write scale_rewards=group; "):
        trl_schema.check("grpo", {"scale_rewards": "yes"})
    with pytest.raises(OrchError, match=r"vllm_mode takes one of server, colocate"):
        trl_schema.check_config_keys("rloo", {"vllm_mode": True}, "c.yaml")  # no mapping: a bool is refused


def test_every_registered_trainer_and_each_strategy_orch_supports_has_a_recipe():
    """Each trainer of the registry, PEFT and QLoRA, every sharding strategy (DDP, FSDP2, ZeRO-1/2/3, offload, context
    and sequence parallelism), the three model families and a vLLM server: at least one recipe each."""
    from orchestrator.launch.recipe_info import summarize

    rows = [summarize(load_task(p)) for p in TASKS]
    assert {r.trainer.split("+")[0] for r in rows} == set(trainers.SPECS)
    assert {"sft+lora", "dpo+lora", "sft+qlora"} <= {r.trainer for r in rows}
    strategies = {r.strategy for r in rows}
    for needed in ("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3-offload", "fsdp2+cp2", "zero3+sp2"):
        assert needed in strategies, needed
    families = {r.model.split("/")[1].split("-")[0].rstrip("0123456789.") for r in rows}
    assert {"Phi", "Llama", "Qwen"} <= families
    assert any(r.strategy.endswith("+vllm-server") for r in rows)


def test_long_context_configs_follow_trl_rules():
    cp = yaml.safe_load((RECIPES_DIR / "accelerate" / "fsdp2_cp_qwen3.yaml").read_text())
    assert cp["fsdp_config"]["fsdp_version"] == 2 and cp["fsdp_config"]["fsdp_activation_checkpointing"] is True
    long = yaml.safe_load((RECIPES_DIR / "trl" / "qwen3_sft_long.yaml").read_text())
    assert long["attn_implementation"] == "sdpa" and long["gradient_checkpointing"] is False
    alst = yaml.safe_load((RECIPES_DIR / "accelerate" / "alst_ulysses_sp2.yaml").read_text())
    assert alst["distributed_type"] == "DEEPSPEED" and alst["deepspeed_config"]["zero_stage"] == 3


def test_a_hub_that_cannot_be_reached_is_named_as_the_network_not_the_data():
    """A laptop that cannot reach the Hub gets a note naming the connection's own error (datasets alone retries and
    then raises about a closed HTTP client), and the launch goes on: the data are not at fault."""
    import json
    import subprocess
    import sys

    request = {"dataset": "trl-lib/ultrafeedback_binarized", "config": None, "split": "train",
               "model": "microsoft/Phi-3-mini-4k-instruct", "trainer": "dpo", "chat_template_path": None}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run([sys.executable, "-m", "orchestrator.rehearsal.data"], input=json.dumps(request),
                          capture_output=True, text=True, env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"})  # fmt: skip
    line = next(x for x in done.stdout.splitlines() if x.startswith("ORCH_DATA "))
    assert json.loads(line.split(" ", 1)[1]) == {
        "fatal": False,
        "error": "cannot reach the Hub from here for trl-lib/ultrafeedback_binarized "
        "(ConnectError: [Errno 111] Connection refused)",
    }


@pytest.mark.e2e
def test_assistant_only_loss_is_checked_against_the_models_own_chat_template(tmp_path):
    """TRL's SFT trainer masks the loss to the assistant's turns with a template's `{% generation %}` markers, patching
    the templates it knows and refusing others, when the trainer is built on the nodes: the data check asks TRL with
    the model's own tokenizer (the rehearsal's tiny model has a template with markers, so it cannot tell)."""
    import json

    from orchestrator.train import smoke_build

    data = tmp_path / "chats"
    data.mkdir()
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    (data / "train.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    smoke = smoke_build._tokenizer([json.dumps(turns)] * 4)  # the smoke models' tokenizer: its template has markers
    smoke.save_pretrained(tmp_path / "smoke")
    smoke.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # unknown to TRL
    smoke.save_pretrained(tmp_path / "own")

    def check(model) -> dict:  # the data check's own function, in this process (its CLI reads the same JSON)
        from orchestrator.rehearsal import data as datacheck

        return datacheck.check({"dataset": str(data), "config": None, "split": "train", "model": str(model),
                                "trainer": "sft", "chat_template_path": None, "assistant_only_loss": True})  # fmt: skip

    refused = check(tmp_path / "own")
    assert refused["fatal"] is True and refused["error"].startswith(
        f"assistant_only_loss=true with {tmp_path / 'own'}'s chat template: ValueError: The chat template is not "
        "training-compatible"
    ), refused
    assert refused["error"].endswith("; set chat_template_path to a template with generation markers")
    accepted = check(tmp_path / "smoke")
    assert "fatal" not in accepted and accepted["conversational"] is True, accepted


@pytest.mark.e2e
def test_the_data_check_says_when_trl_would_drop_the_first_row_not_truncate_it(project):
    """DPO drops a row whose prompt alone fills max_length (with truncation_mode=keep_start, TRL's default) where SFT
    truncates: the one-row line says which, with the prompt's own tokens as TRL's filter counts them."""
    import json

    from orchestrator.core import smoke

    tiny = smoke.plan("microsoft/Phi-3-mini-4k-instruct", "dpo")
    smoke.ensure(tiny)
    pairs = project / "pairs"
    pairs.mkdir()
    row = {"prompt": [{"role": "user", "content": "Tell me a long story. " * 40}],
           "chosen": [{"role": "assistant", "content": "Once."}], "rejected": [{"role": "assistant", "content": "No."}]}
    (pairs / "train.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["run", "phi3_dpo_fsdp", "--dry-run", "--skip-optimizer", "--no-rehearsal", f"dataset_name={pairs}",
            f"model_name_or_path={tiny.dir / 'model'}", "max_length=64"]  # fmt: skip
    env = {"ORCH_DATA_CHECK": "on", "HF_HUB_OFFLINE": "1"}
    for extra, said in (([], r"its prompt alone is [\d,]+ tokens with the chat template: TRL's dpo trainer drops a "
                             r"row whose prompt fills max_length 64"),
                        (["truncation_mode=keep_end"], r"[\d,]+ tokens with the chat template: max_length 64 truncates "
                                                       r"it \(\d+% cut\)")):  # fmt: skip
        result = orch(*argv, *extra, cwd=project, env=env)
        assert result.returncode == 0, result.stderr
        line = next(x for x in result.stdout.splitlines() if x.startswith("[orch] data: "))
        assert re.fullmatch(rf"\[orch\] data: {pairs}, first row: chosen, prompt, rejected; {said}", line), line
    # max_length: null (a YAML null: no override gives one) truncates nothing, and drops nothing: TRL's 1024 was said
    config = project / "recipes" / "trl" / "phi3_dpo.yaml"
    config.write_text(re.sub(r"(?m)^max_length: \d+$", "max_length: null", config.read_text()))
    result = orch(*argv[:-1], cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("[orch] data: "))
    assert re.fullmatch(rf"\[orch\] data: {pairs}, first row: chosen, prompt, rejected; [\d,]+ tokens with the chat "
                        r"template, untruncated \(max_length: null\)", line), line  # fmt: skip
    assert re.search(r"^memory: .* 4 x \d+ tokens per device \(max_length: null truncates nothing: each sequence "
                     r"taken as the model's positions\)", result.stdout, re.M), result.stdout  # fmt: skip


@pytest.mark.unit
def test_a_datasets_mixture_replaces_dataset_name_in_the_data_check(monkeypatch):
    """TRL's scripts load a `datasets:` mixture in place of dataset_name: the one-row check of dataset_name would judge
    a dataset the nodes never read."""
    from orchestrator.launch import datacheck
    from orchestrator.launch.resolved import resolve

    monkeypatch.setenv("ORCH_DATA_CHECK", "on")
    phi3 = recipes.load(str(ROOT / "recipes" / "phi3_dpo_fsdp.yaml"))
    mixed = resolve(phi3, trl_overrides={"datasets": '[{"path": "org/prefs"}]', "dataset_name": "no/such-dataset"})
    assert datacheck.run(mixed) == (
        "[orch] data: a `datasets` mixture: not checked here (the nodes load it with TRL's get_dataset)"
    )


@pytest.mark.e2e
def test_an_evaluation_split_the_dataset_lacks_is_refused_before_launch(tmp_path):
    """With an eval_strategy, TRL's scripts look dataset_test_split (default `test`) up on the nodes, after the model
    loaded: the data check streams a row of it too (launch/datacheck.py sends the split with the strategy)."""
    import json

    from orchestrator.rehearsal import data as datacheck

    data = tmp_path / "chats"
    data.mkdir()
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    (data / "train.jsonl").write_text(json.dumps({"messages": turns}) + "\n")

    def check(split) -> dict:
        return datacheck.check({"dataset": str(data), "config": None, "split": "train", "model": str(tmp_path / "none"),
                                "trainer": "sft", "eval": {"split": split, "strategy": "steps"}})  # fmt: skip

    assert check("test") == {
        "fatal": True,
        "error": f"dataset {data}: eval_strategy=steps evaluates on dataset_test_split=test, which it lacks "
        "(ValueError: Bad split: test. Available splits: ['train']); set dataset_test_split to one of its splits, "
        "or eval_strategy=no",
    }
    accepted = check("train")
    assert "fatal" not in accepted and accepted["columns"] == ["messages"], accepted
    trained = datacheck.check({"dataset": str(data), "config": None, "split": "validation", "trainer": "sft",
                               "model": str(tmp_path / "none")})  # fmt: skip
    assert trained == {
        "fatal": True,
        "error": f"dataset {data}: dataset_train_split=validation: ValueError: Bad split: validation. Available "
        "splits: ['train']; set dataset_train_split to one of them",
    }


@pytest.mark.e2e
def test_a_hub_style_dataset_is_checked_one_row_before_a_cloud_launch(project):
    """`orch run` streams one row of the recipe's dataset (here a dataset saved to disk, read by datasets' streaming
    loader as a Hub dataset would be), checks its columns, applies the model's chat template and says what
    max_length cuts; a dataset without the trainer's columns stops the launch (exit 2, one line)."""
    import json

    from orchestrator.core import smoke

    tiny = smoke.plan("meta-llama/Llama-3.1-8B-Instruct", "sft")
    smoke.ensure(tiny)
    good, bad = project / "chats", project / "qa"
    good.mkdir()
    bad.mkdir()
    turns = [{"role": "user", "content": "Tell me a long story. " * 40}, {"role": "assistant", "content": "Once."}]
    (good / "train.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    (bad / "train.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    argv = ["run", "llama3_sft_lora_ddp", "--dry-run", "--skip-optimizer", "--secret", "HF_TOKEN=x",
            f"model_name_or_path={tiny.dir / 'model'}", "max_length=64"]  # fmt: skip
    env = {"ORCH_DATA_CHECK": "on", "HF_HUB_OFFLINE": "1"}
    result = orch(*argv, f"dataset_name={good}", cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("[orch] data: "))
    assert re.fullmatch(rf"\[orch\] data: {good}, first row: messages; [\d,]+ tokens with the chat template: "
                        r"max_length 64 truncates it \(\d+% cut\)", line), line  # fmt: skip
    refused = orch(*argv, f"dataset_name={bad}", cwd=project, env=env)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.strip() == (
        f"orch: error: dataset {bad}: its first row has no column completion (it has answer, prompt); TRL's sft "
        'trainer reads messages or text or prompt + completion, e.g. {"messages": [{"role": "user", "content": "Hi"}, '
        '{"role": "assistant", "content": "Hello!"}]}'
    )
    assert not (project / "sky_jobs").exists()
