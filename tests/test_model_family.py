"""A model's family from its own config.json (node/model_config.py): a user's own model directory or a fine-tune named
for itself is rehearsed as what it is, on the laptop and on the head node, and a variant orch builds no tiny model of
(a mixture of experts named like its dense family) is refused in one line instead of rehearsed as the dense model."""

import json
import re
from pathlib import Path

import pytest
from conftest import Rehearsed, orch
from hub_standin import Hub

from orchestrator.core.errors import OrchError
from orchestrator.node import model_config
from orchestrator.rehearsal import driver

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
         "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
         "tie_word_embeddings": True}  # fmt: skip  # Qwen2.5-0.5B's shape
BIG = {**QWEN2, "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
       "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}  # Qwen2.5-7B's shape
MOE = {**QWEN2, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128}
UNKNOWN_NAME = "open-thoughts/OpenThinker-7B"  # a Qwen2 fine-tune whose name says no family
NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "_load_in_4bit": True, "load_in_8bit": False,
       "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
BNB_4BIT = "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit"  # a pre-quantised checkpoint, as unsloth's QLoRA repos are
GPTQ = "someone/Llama-3.1-8B-Instruct-GPTQ"


def model_dir(root: Path, name: str, config: dict | None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def hub(tmp_path):
    """The Hub with the Qwen2 fine-tune (7B), a mixture of experts named Qwen3, a gated and a public 0.5B Qwen2 named
    for nothing, a repo without a config.json, and a Llama 8B quantised with bitsandbytes and with GPTQ."""
    root = tmp_path / "hub"
    model_dir(root / "models", UNKNOWN_NAME, BIG)
    model_dir(root / "models", "Qwen/Qwen3-30B-A3B", MOE)
    model_dir(root / "models", "someone/gated-7b", QWEN2)
    model_dir(root / "models", "someone/small-sft", QWEN2)
    (model_dir(root / "models", "someone/weights-only", None) / "model.safetensors").write_bytes(b"")
    model_dir(root / "models", BNB_4BIT, {**LLAMA_8B, "quantization_config": NF4})
    model_dir(root / "models", GPTQ, {**LLAMA_8B, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    with Hub(root, gated={"someone/gated-7b"}) as server:
        yield server


def point_at(endpoint: str, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def asks(hub, tmp_path, monkeypatch):
    """model_config's lookups ask the stand-in Hub with an empty cache (huggingface_hub builds its file URLs from a
    template made at its import, from HF_ENDPOINT), and no lookup is remembered between a test's calls."""
    from huggingface_hub import constants

    point_at(hub.endpoint, monkeypatch)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    model_config.forget()
    yield hub
    model_config.forget()


@pytest.mark.unit
def test_a_local_models_config_names_its_family_where_its_name_does_not(tmp_path):
    model_config.forget()
    mine = model_dir(tmp_path, "my-sft-run/final", QWEN2)
    assert model_config.family(str(mine)).model_type == "qwen2"
    assert model_config.family(str(mine / "config.json")).model_type == "qwen2"  # the file itself
    # a name that says qwen3, a config that says it is the mixture of experts: refused, not rehearsed as dense Qwen3
    moe = model_dir(tmp_path, "Qwen3-30B-A3B", MOE)
    with pytest.raises(OrchError) as refused:
        model_config.family(str(moe))
    assert not isinstance(refused.value, model_config.Unknown)
    assert str(refused.value) == (
        f"model '{moe}' is a qwen3_moe model (model_type in {moe}/config.json); smoke mode and the rehearsal build "
        "tiny models of phi3, qwen3, qwen2, llama only: train one of those, or launch it unrehearsed (--no-rehearsal "
        "--env ORCH_REHEARSAL=off; not --smoke)"
    )
    # a directory without config.json: its name, where it says; else why neither does
    assert model_config.family(str(model_dir(tmp_path, "llama-ckpt", None))).model_type == "llama"
    bare = model_dir(tmp_path, "ckpt", None)
    with pytest.raises(model_config.Unknown, match=f"config.json not read, {bare} is not a directory holding a "
                                                   "config.json, nor one$"):  # fmt: skip
        model_config.family(str(bare))
    weights = bare / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    assert model_config.read(str(weights)).config is None  # read as JSON only when it is a .json file


@pytest.mark.unit
def test_the_recipes_models_are_known_by_name_and_never_looked_up(monkeypatch):
    import huggingface_hub

    model_config.forget()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("looked up"))
    for model, family in (("Qwen/Qwen2.5-0.5B-Instruct", "qwen2"), ("meta-llama/Llama-3.1-8B-Instruct", "llama"),
                          ("microsoft/Phi-3-mini-4k-instruct", "phi3"), ("Qwen/Qwen3-8B", "qwen3")):  # fmt: skip
        assert model_config.read(model) == model_config.Found(None)
        assert model_config.family(model).model_type == family


@pytest.mark.unit
def test_a_hub_models_config_names_its_family_and_each_failure_says_why(asks, monkeypatch):
    assert model_config.family(UNKNOWN_NAME).model_type == "qwen2"
    assert f"GET /{UNKNOWN_NAME}/resolve/main/config.json" in asks.requests
    with pytest.raises(OrchError, match=r"^model 'Qwen/Qwen3-30B-A3B' is a qwen3_moe model \(model_type in "
                                        r"Qwen/Qwen3-30B-A3B's config.json\)"):  # fmt: skip
        model_config.family("Qwen/Qwen3-30B-A3B")
    why = {
        "someone/gated-7b": "someone/gated-7b is gated (set HF_TOKEN, or pass --secret HF_TOKEN)",
        "someone/weights-only": "someone/weights-only has no config.json",
        "someone/not-there": "someone/not-there is not on the Hub, or is private (set HF_TOKEN)",
        "/checkpoints/sft/final": "'/checkpoints/sft/final' is neither a local path nor a Hub id",  # a node's path
    }
    for model, reason in why.items():
        with pytest.raises(model_config.Unknown) as unknown:
            model_config.family(model)
        said = "neither its name nor its config.json says which family (phi3, qwen3, qwen2, llama) it is of"
        assert str(unknown.value) == f"model {model!r}: {said}: config.json not read, {reason}"
    # the head node's memory check, before the model downloads, estimates it from that config.json too
    from orchestrator.core.accelerate_config import AccelerateConfig
    from orchestrator.node import memory as node_memory

    ddp = AccelerateConfig.of({"distributed_type": "MULTI_GPU"})
    said = node_memory.check({"ORCH_DEVICE": "cpu"}, "sft", {"model_name_or_path": "someone/small-sft"}, ddp, 1, 1)
    assert said.startswith("memory (DDP, 1 x 1): CPU processes; host memory at load: ~1.8 GiB"), said  # fp32
    monkeypatch.setenv("HF_TOKEN", asks.token)
    model_config.forget()
    assert model_config.family("someone/gated-7b").model_type == "qwen2"
    # off the Hub: what the cache holds still says it; what it does not, says that
    point_at("http://127.0.0.1:9", monkeypatch)
    model_config.forget()
    assert model_config.family(UNKNOWN_NAME).model_type == "qwen2"
    with pytest.raises(model_config.Unknown, match="config.json not read, (the Hub cannot be reached from here|no "
                                                   "answer from the Hub)"):  # fmt: skip
        model_config.family("someone/elsewhere-7b")


@pytest.mark.unit
def test_the_local_smoke_run_and_the_head_nodes_rehearsal_build_the_models_own_family(tmp_path, handed):
    """`orch run --local --smoke` and `orch node --rehearse` (plain `sky launch` users get it too) on a user's own
    model directory: its tiny model is a Qwen2, as config.json says; a mixture of experts stops both in one line."""
    from orchestrator.core.accelerators import Gpus
    from orchestrator.launch import recipe
    from orchestrator.launch.backends import local_backend
    from orchestrator.launch.resolved import resolve
    from orchestrator.node import exec as node_exec

    model_config.forget()
    mine, moe = model_dir(tmp_path, "my-sft-run", QWEN2), model_dir(tmp_path, "my-moe", MOE)
    for model in (mine, moe):
        launch = resolve(recipe.load("phi3_dpo_fsdp"), nodes=2, gpus=Gpus("CPU", 1),
                         trl_overrides={"model_name_or_path": str(model)})  # fmt: skip
        if model is moe:
            with pytest.raises(OrchError, match="is a qwen3_moe model"):
                local_backend._smoke(launch, {}, {})
        else:
            smoked, artifacts = local_backend._smoke(launch, {}, {})
            assert artifacts.model_type == "qwen2" and smoked.setting("model_name_or_path") == f"{artifacts.dir}/model"

    head = {"SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "8",
            "SKYPILOT_SETUP_NODE_RANK": "0", "TRL_TRAINER": "dpo", "TRL_CONFIG": "recipes/trl/phi3_dpo.yaml",
            "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_phi3.yaml", "GLOBAL_BATCH_SIZE": "64",
            "CHECKPOINT_ROOT": "/checkpoints", "ORCH_MEMORY_CHECK": "off", "ORCH_PRECISION_CHECK": "off",
            "ORCH_CUDA_ARCH_CHECK": "off"}  # fmt: skip
    with pytest.raises(Rehearsed):
        node_exec.rehearse({**head, "TRL_OVERRIDES": f"model_name_or_path={mine}"})
    assert [b.smoke[0] for b in handed] == ["qwen2"]
    with pytest.raises(OrchError, match="is a qwen3_moe model"):
        node_exec.rehearse({**head, "TRL_OVERRIDES": f"model_name_or_path={moe}"})


@pytest.mark.e2e  # dry runs whose rehearsal imports the training stack
def test_orch_run_checks_a_hub_fine_tune_as_its_config_says_and_refuses_what_it_cannot_build(hub, project):
    """The laptop reads config.json from the Hub: the 7B fine-tune is refused on the recipe's L4s by the memory estimate
    (before: no shape, launched) and, with LoRA, rehearsed as the Qwen2 it is (before: the rehearsal was skipped and
    the head node refused it once the cluster was up); the mixture of experts is refused by both checks before anything
    is written; a model the laptop cannot look up is left to the head node's rehearsal, and says why."""
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(project / "hf"), "ORCH_DATA_CHECK": "off",
           "ORCH_KERNEL_CHECK": "off", "ORCH_REHEARSAL": "on"}  # fmt: skip
    argv = ["run", "qwen25_sft_ddp", "--dry-run", "--skip-optimizer"]

    def refused(*words: str) -> str:
        result = orch(*argv, *words, cwd=project, env=env)
        assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr[-2000:]
        (line,) = result.stderr.strip().splitlines()
        return line

    assert refused(f"model_name_or_path={UNKNOWN_NAME}").startswith(
        "orch: error: 7.62B sft (full, 8 x 2048 tokens per device) needs ~")  # fmt: skip
    done = orch(*argv, f"model_name_or_path={UNKNOWN_NAME}", "use_peft=true", "per_device_train_batch_size=2",
                cwd=project, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^memory: ~[\d.]+ GiB per GPU \(.*\) under DDP on 4 GPUs, .*each L4 has 24 GiB$", done.stdout,
                     re.M), done.stdout  # fmt: skip
    assert "swapped here: tiny qwen2 model and data" in done.stdout
    moe = "model_name_or_path=Qwen/Qwen3-30B-A3B"
    assert refused(moe) == (
        "orch: error: Qwen/Qwen3-30B-A3B's config.json: a config.json the memory estimate cannot read "
        "(num_experts=128: a mixture of experts, and this estimate counts dense decoders only); --env "
        "ORCH_MEMORY_CHECK=off launches without the estimate"
    )
    assert refused(moe, "--env", "ORCH_MEMORY_CHECK=off").startswith(
        "orch: error: model 'Qwen/Qwen3-30B-A3B' is a qwen3_moe model (model_type in Qwen/Qwen3-30B-A3B's config.json)")
    assert not (project / "sky_jobs").exists()
    gated = orch(*argv, "model_name_or_path=someone/gated-7b", cwd=project, env=env)
    assert gated.returncode == 0, gated.stderr[-2000:]
    assert "[orch] rehearsal: not here (model 'someone/gated-7b': neither its name nor its config.json says which " \
        "family (phi3, qwen3, qwen2, llama) it is of: config.json not read, someone/gated-7b is gated (set HF_TOKEN, " \
        "or pass --secret HF_TOKEN)); the head node rehearses in its setup, where it reads config.json" in gated.stdout
    assert "memory: not estimated (orch has no shape for someone/gated-7b, whose config.json was not read: " \
        "someone/gated-7b is gated (set HF_TOKEN, or pass --secret HF_TOKEN); `orch plan path/to/config.json` reads " \
        "one)" in gated.stdout
    plan = orch("plan", UNKNOWN_NAME, "--peft", "lora", cwd=project, env=env)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.startswith(f"{UNKNOWN_NAME}: 7.6B parameters, sft LoRA"), plan.stdout


@pytest.mark.unit
def test_a_quantised_checkpoint_is_counted_as_the_setting_that_loads_one_or_refused():
    """A bitsandbytes checkpoint loads through the quantizer load_in_4bit/8bit uses: its memory is QLoRA's with an
    adapter and not estimated without one (transformers refuses that; the rehearsal shows it); another method's is
    refused, naming it."""
    from orchestrator.core import fit, models
    from orchestrator.core.accelerate_config import AccelerateConfig

    four, gptq = {**LLAMA_8B, "quantization_config": NF4}, {**LLAMA_8B, "quantization_config": {"quant_method": "gptq"}}
    assert models.quantized("m", four) == "load_in_4bit" and models.quantized("m", LLAMA_8B) is None
    eight = {**LLAMA_8B, "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    assert models.quantized("m", eight) == "load_in_8bit"
    with pytest.raises(OrchError) as refused:
        models.quantized("m", gptq)
    assert str(refused.value).startswith(
        "model 'm' is a gptq checkpoint (quantization_config in its config.json); orch rehearses and estimates "
        "full-precision and bitsandbytes checkpoints only")  # fmt: skip
    with pytest.raises(OrchError, match="is a gptq checkpoint"):
        models.family_of("m", gptq)
    ddp = AccelerateConfig.of({"distributed_type": "MULTI_GPU"})

    def setup(config, **settings):
        return fit.setup_of("sft", {"model_name_or_path": "m", **settings}, ddp, 8, config, "m's config.json")

    assert setup(four, use_peft=True).method == "qlora" == setup(LLAMA_8B, use_peft=True, load_in_4bit=True).method
    assert setup(LLAMA_8B, use_peft=True).method == "lora"
    assert setup(four) is None and setup(gptq, use_peft=True) is None
    # and each None says why (the dry run's and the head node's memory lines)
    assert fit.unestimated({"model_name_or_path": "m"}, four) == (
        "m is a bitsandbytes checkpoint, which trains with adapters only (use_peft true)")  # fmt: skip
    assert fit.unestimated({"model_name_or_path": "m", "use_peft": True}, gptq).startswith("model 'm' is a gptq ")
    assert fit.unestimated({"model_name_or_path": "x/y"}, None, "", "offline") == (
        "orch has no shape for x/y, whose config.json was not read: offline")  # fmt: skip
    assert fit.unestimated({"model_name_or_path": "m", "use_peft": True}, four) == ""


@pytest.mark.unit
def test_the_head_node_rehearses_a_bitsandbytes_checkpoint_as_load_in_4bit_loads_it(tmp_path, handed):
    from orchestrator.node import exec as node_exec

    model_config.forget()
    model = model_dir(tmp_path, "llama-8b-bnb", {**LLAMA_8B, "quantization_config": NF4})
    head = {"SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n", "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "8",
            "SKYPILOT_SETUP_NODE_RANK": "0", "TRL_TRAINER": "sft", "TRL_CONFIG": "recipes/trl/llama3_sft_lora.yaml",
            "ACCELERATE_CONFIG": "multi_gpu", "GLOBAL_BATCH_SIZE": "64", "CHECKPOINT_ROOT": "/checkpoints",
            "ORCH_MEMORY_CHECK": "off", "ORCH_PRECISION_CHECK": "off", "ORCH_CUDA_ARCH_CHECK": "off",
            "TRL_OVERRIDES": f"model_name_or_path={model}"}  # fmt: skip
    for env in (head, {**head, "ORCH_SMOKE": "on"}):  # a smoke run trains the tiny model, unquantised
        with pytest.raises(Rehearsed):
            node_exec.rehearse(env)
    (real, smoke) = handed
    words = real.substitute
    assert words[words.index("--load_in_4bit") + 1] == "true" and real.quantized and real.bitsandbytes
    assert "--load_in_4bit" not in smoke.substitute and not smoke.quantized
    assert "the checkpoint's bitsandbytes quantisation applied to it" in driver.swaps(real)
    from orchestrator.core.accelerate_config import AccelerateConfig
    from orchestrator.node import memory

    said = memory.check({}, "sft", {"model_name_or_path": str(model)}, AccelerateConfig.of({}), 1, 8)
    assert said == f"memory: not checked ({model} is a bitsandbytes checkpoint, which trains with adapters only " \
        "(use_peft true))", said  # its rehearsal then refuses the full fine-tune in transformers' words


@pytest.mark.e2e  # dry runs whose rehearsal imports the training stack and quantises on CPU
def test_orch_run_rehearses_a_bitsandbytes_checkpoint_through_transformers_quantizer(hub, project):
    """unsloth's QLoRA checkpoints: the QLoRA recipe trains one (rehearsed, its memory counted in 4 bits); full
    fine-tuning of it is refused in transformers' own words; a recipe without the quant extra is told to add it; a
    GPTQ checkpoint is refused, naming the method."""
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(project / "hf"), "ORCH_DATA_CHECK": "off",
           "ORCH_KERNEL_CHECK": "off", "ORCH_REHEARSAL": "on", "HF_TOKEN": "hf_x"}  # fmt: skip
    argv = ["run", "llama3_70b_qlora_fsdp", "--dry-run", "--skip-optimizer", "--secret", "HF_TOKEN"]
    done = orch(*argv, f"model_name_or_path={BNB_4BIT}", cwd=project, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^memory: ~[\d.]+ GiB per GPU \(frozen weights 0\.\d, ", done.stdout, re.M), done.stdout  # 4-bit
    assert re.search(r"^\[orch\] rehearsed .*, \d+ Linear4bit base layers, ", done.stdout, re.M), done.stdout

    def refused(*words: str) -> str:
        result = orch(*words, cwd=project, env=env)
        assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr[-2000:]
        (line,) = result.stderr.strip().splitlines()
        return line

    assert refused(*argv, f"model_name_or_path={BNB_4BIT}", "use_peft=false", "load_in_4bit=false").endswith(
        "would fail on its GPUs (trainer: ValueError: You cannot perform fine-tuning on purely quantized models. "
        "Please attach trainable adapters on top of the quantized model to correctly perform fine-tuning. Please see: "
        "https://huggingface.co/docs/transformers/peft for more details)")  # fmt: skip
    lora = ["run", "llama3_sft_lora_ddp", "--dry-run", "--skip-optimizer", "--secret", "HF_TOKEN"]
    assert refused(*lora, f"model_name_or_path={BNB_4BIT}") == (
        f"orch: error: {BNB_4BIT} is a bitsandbytes-quantised checkpoint: the nodes get bitsandbytes with orch's quant "
        "extra, which the recipe's setup does not install (train,gpu); add quant to the recipe's setup: bash "
        "scripts/node-setup.sh train,gpu,quant")  # fmt: skip
    assert refused(*argv, f"model_name_or_path={GPTQ}") == (
        f"orch: error: model '{GPTQ}' is a gptq checkpoint (quantization_config in {GPTQ}'s config.json); orch "
        "rehearses and estimates full-precision and bitsandbytes checkpoints only: train its unquantised original "
        "(with use_peft and load_in_4bit for QLoRA)")  # fmt: skip


@pytest.mark.unit
def test_a_config_without_a_decoders_field_names_the_field():
    """A config.json the estimate cannot read says which field it lacks, not a KeyError's repr."""
    from orchestrator.core import models

    with pytest.raises(OrchError, match=r"^mine/config.json: a config.json the memory estimate cannot read \(it has no "
                                        r"\w+, which a decoder's config gives\)$"):  # fmt: skip
        models.arch_of("mine", {"model_type": "llama"}, where="mine/config.json")
