"""orch ls / show / cp, and key=value overrides checked against the trainer's own argument list."""

import pytest
from conftest import ROOT, orch

from orchestrator.core import trl_schema
from orchestrator.core.errors import OrchError

pytestmark = pytest.mark.cli


def test_ls_lists_every_recipe_with_its_shape():
    result = orch("ls")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["RECIPE", "TRAINER", "STRATEGY", "MODEL", "GPUS/NODE", "NODES"]
    row = next(x for x in lines if x.startswith("phi3_dpo_fsdp "))
    assert row.split() == ["phi3_dpo_fsdp", "dpo", "fsdp2", "microsoft/Phi-3-mini-4k-instruct", "A100:8", "1"]
    assert len(lines) - 1 == len(list((ROOT / "recipes").glob("*.yaml")))


def test_ls_from_another_directory_reads_orchs_own_recipes_where_they_live(tmp_path):
    """From a directory without recipes, `orch ls` listed orch's own with `?` for strategy and model: it read their
    paired files relative to the working directory. It reads them under orch's root and says where to run them."""
    result = orch("ls", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    row = next(x for x in lines if x.startswith("phi3_dpo_fsdp "))
    assert row.split() == ["phi3_dpo_fsdp", "dpo", "fsdp2", "microsoft/Phi-3-mini-4k-instruct", "A100:8", "1"]
    rows = lines[1 : lines.index("")]
    assert len(rows) == len(list((ROOT / "recipes").glob("*.yaml"))) and not any(" ? " in x for x in rows), rows
    assert lines[-1] == (f"{len(rows)} of these are orch's own, in {ROOT / 'recipes'}: run or copy them from {ROOT} "
                         "(their files and scripts/node-setup.sh are relative to it)")  # fmt: skip
    assert "orch's own" not in orch("ls").stdout  # from orch's root: nothing to say
    for argv in (("show", "phi3_dpo_fsdp"), ("cp", "phi3_dpo_fsdp", "mine")):  # and the commands that use one say it
        done = orch(*argv, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.endswith(f"; run orch from {ROOT} or fix the path\n"), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_show_applies_and_checks_overrides():
    result = orch("show", "phi3_dpo_fsdp", "beta=0.2", "learning_rate=1e-6")
    assert result.returncode == 0, result.stderr
    assert "TRL_OVERRIDES: beta=0.2 learning_rate=1e-6" in result.stdout
    assert (
        "\nbeta: '0.2'\n" in result.stdout and "fsdp_transformer_layer_cls_to_wrap: Phi3DecoderLayer" in result.stdout
    )
    bad = orch("show", "phi3_dpo_fsdp", "betta=0.2")
    assert bad.returncode == 2 and "did you mean beta?" in bad.stderr


def test_cp_makes_a_template_that_names_its_own_files(project):
    result = orch("cp", "qwen25_sft_ddp", "my_sft", cwd=project)
    assert result.returncode == 0, result.stderr
    text = (project / "recipes" / "my_sft.yaml").read_text()
    assert "TRL_CONFIG: recipes/trl/my_sft.yaml" in text
    assert "ACCELERATE_CONFIG: recipes/accelerate/my_sft.yaml" in text  # the multi_gpu profile, copied to edit
    assert "orch run my_sft" in text and "sky launch -c my-sft recipes/my_sft.yaml" in text
    assert "output_dir: outputs/my_sft" in (project / "recipes" / "trl" / "my_sft.yaml").read_text()
    import sky
    assert sky.Task.from_yaml(str(project / "recipes" / "my_sft.yaml")).name == "my-sft"
    listed = orch("ls", cwd=project)
    assert any(line.startswith("my_sft ") for line in listed.stdout.splitlines())


def test_cp_refuses_to_overwrite_without_force(project):
    assert orch("cp", "phi3_dpo_fsdp", "mine", cwd=project).returncode == 0
    (project / "recipes" / "trl" / "mine.yaml").write_text("edited: true\n")
    again = orch("cp", "phi3_dpo_fsdp", "mine", cwd=project)
    assert again.returncode == 2
    assert "recipes/mine.yaml already exists; pass --force to overwrite it" in again.stderr
    assert (project / "recipes" / "trl" / "mine.yaml").read_text() == "edited: true\n"  # untouched
    assert orch("cp", "phi3_dpo_fsdp", "mine", "--force", cwd=project).returncode == 0
    assert "beta" in (project / "recipes" / "trl" / "mine.yaml").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cp", "phi3_dpo_fsd", "x"], "unknown recipe 'phi3_dpo_fsd'; did you mean phi3_dpo_fsdp? `orch ls` lists"),
        (["cp", "phi3_dpo_fsdp", "a b"], "DEST 'a b' must be a name like my_dpo"),
        (["cp", "phi3_dpo_fsdp", "phi3_dpo_fsdp"], "phi3_dpo_fsdp is the recipe itself"),
    ],
)
def test_cp_errors_name_the_next_step(project, argv, message):
    result = orch(*argv, cwd=project)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert sorted(p.name for p in (project / "recipes").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "recipes").glob("*.yaml")
    )


@pytest.mark.parametrize(
    "trainer, overrides, message",
    [
        ("dpo", {"lerning_rate": "1e-5"}, "dpo has no TRL argument 'lerning_rate'; did you mean learning_rate?"),
        ("dpo", {"max_steps": "ten"}, "max_steps takes an integer"),
        ("sft", {"learning_rate": "fast"}, "learning_rate takes a number"),
        ("sft", {"packing": "maybe"}, "packing takes true or false"),
        ("dpo", {"dtype": "fp8"}, "dtype takes one of auto, bfloat16, float16, float32"),
        ("grpo", {"num_generations": "8.5"}, "num_generations takes an integer"),
        ("kto", {"num_generations": "4"}, "kto has no TRL argument 'num_generations'"),
    ],
)
def test_overrides_are_checked_against_the_trainer(trainer, overrides, message):
    with pytest.raises(OrchError, match=message.replace("?", r"\?")):
        trl_schema.check(trainer, overrides)


def test_valid_overrides_pass():
    trl_schema.check(
        "grpo",
        {
            "num_generations": "4",
            "use_vllm": "false",
            "reward_funcs": "accuracy_reward",
            "learning_rate": "1e-6",
            "dtype": "bfloat16",
            "max_steps": "10",
        },
    )
