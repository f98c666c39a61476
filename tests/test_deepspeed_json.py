"""An Accelerate config that names a DeepSpeed JSON (deepspeed_config.deepspeed_config_file): its ZeRO settings are
read where the config is loaded, as accelerate's DeepSpeed plugin reads them. Before, the launch side planned
"ZeRO-?": every rank loading the whole checkpoint, offload not seen, no final model on disk, a ZeRO-3 JSON without
16-bit gathering passed until the rehearsal; the rehearsal's cache kept the JSON's old result after an edit, and
`orch cp` left the copy naming the original's JSON."""

import base64
import json
import re

import pytest
import yaml
from conftest import orch

from orchestrator.core import configs, strategy
from orchestrator.core.accelerate_config import (
    DEEPSPEED_JSON,
    FALSE_WORDS,
    FSDP_FLAGS,
    OFFLOAD_DEVICES,
    TRUE_WORDS,
    ZERO_STAGES,
)
from orchestrator.core.errors import OrchError

JSONS = {
    "stage 3, everything offloaded, gathered": {"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True}},
    "stage 3, the optimizer offloaded, not gathered": {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "stage3_gather_16bit_weights_on_model_save": False}},
    "stage 2 on nvme": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}},
    "stage 1, autos": {"zero_optimization": {"stage": 1, "offload_param": {"device": "auto"}},
                       "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
    "stage auto": {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}}},
}  # fmt: skip
STAGE = {"auto": 2}  # accelerate's DeepSpeedPlugin writes its zero_stage, 2, over "auto" (DeepSpeed then runs ZeRO-2)


def write(tmp_path, ds, **extra) -> str:
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = {"distributed_type": "DEEPSPEED",
              "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": True, **extra}}  # fmt: skip
    (tmp_path / "accel.yaml").write_text(yaml.safe_dump(config))
    return "accel.yaml"


@pytest.mark.unit
@pytest.mark.parametrize("name", JSONS)
def test_the_jsons_zero_settings_are_the_configs(tmp_path, name):
    ds = JSONS[name]["zero_optimization"]
    stage = STAGE.get(ds["stage"], ds["stage"])
    config, _ = configs.load_accelerate(write(tmp_path, JSONS[name]), tmp_path)
    assert config.zero_stage == stage
    assert config.offload_optimizer_device == ds.get("offload_optimizer", {}).get("device", "none")
    assert config.offload_param_device == {"auto": "none"}.get(*[ds.get("offload_param", {}).get("device", "none")] * 2)
    assert config.zero3_save_16bit_model is ds.get("stage3_gather_16bit_weights_on_model_save", False)
    assert strategy.of(config).kind == f"zero{stage}" and config.deepspeed_json == JSONS[name]
    assert strategy.of(config).offload is (config.offload_optimizer_device != "none" or "param" in name)


@pytest.mark.e2e
def test_what_orch_reads_is_what_accelerates_deepspeed_plugin_reads(tmp_path):
    """The owners' code: accelerate's DeepSpeedPlugin on the same JSON (a file, the JSON itself, its base64)."""
    from accelerate.utils import DeepSpeedPlugin

    for name, ds in JSONS.items():
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        text = json.dumps(ds)
        for given in (str(tmp_path / "ds.json"), text, base64.urlsafe_b64encode(text.encode()).decode()):
            plugin = DeepSpeedPlugin(hf_ds_config=given)
            accel = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": given}}
            config = configs.deepspeed_settings(configs.parse_accelerate(accel), "a.yaml", tmp_path)
            for field in DEEPSPEED_JSON:
                ours, theirs = getattr(config, field), getattr(plugin, field)
                assert str(ours).lower() == str(theirs).lower(), (name, field, ours, theirs)
            # and the stage DeepSpeed itself is given: the plugin's JSON after its fill
            assert config.zero_stage == plugin.hf_ds_config.config["zero_optimization"]["stage"], name
    from deepspeed.runtime.zero.config import ZeroStageEnum  # the stages DeepSpeedZeroConfig takes on the nodes
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    assert ZERO_STAGES == tuple(sorted({stage.value for stage in ZeroStageEnum}))
    assert set(OFFLOAD_DEVICES) == {device.value for device in OffloadDeviceEnum}


@pytest.mark.e2e
def test_the_accelerate_configs_booleans_are_read_as_accelerate_reads_them(monkeypatch):
    """The FSDP flags and ZeRO-3's init flag go through accelerate's str_to_bool in every rank, which refuses any other
    word (a null too: `accelerate launch` passes `str(value).lower()` on); ZeRO-3's 16-bit save is `== "true"` in
    DeepSpeedPlugin. orch read them all with its own truthy(): "maybe" planned as false, a quoted "yes" as a save."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.environment import str_to_bool

    for word in (*TRUE_WORDS, *FALSE_WORDS, "TRUE", "On"):
        config = configs.parse_accelerate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": word}})
        assert config.fsdp_offload_params is str_to_bool(word.lower(), to_bool=True), word
    for word in ("maybe", "None", "2", "enabled"):
        with pytest.raises(ValueError, match="invalid truth value"):
            str_to_bool(word.lower())
        with pytest.raises(OrchError, match=r"is not a boolean accelerate takes"):
            configs.parse_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero3_init_flag": word}})
    # every FSDP launch argument at both versions, against FullyShardedDataParallelPlugin as `accelerate launch`'s env
    # builds it: orch refuses "maybe" exactly where the plugin's str_to_bool does (FSDP_FLAGS, by version)
    from accelerate.utils import FullyShardedDataParallelPlugin

    from orchestrator.core import accelerate_schema

    arguments = [a for a in accelerate_schema.schema()["launch_arguments"] if a.startswith("fsdp_")]
    arguments.remove("fsdp_version")
    assert set(FSDP_FLAGS) <= set(arguments)
    for version in (1, 2):
        for key in arguments:
            with monkeypatch.context() as env:
                env.setenv("FSDP_VERSION", str(version))
                env.setenv(key.upper(), "maybe")  # FSDP_USE_ORIG_PARAMS, ...: `str(args.fsdp_use_orig_params).lower()`
                try:
                    FullyShardedDataParallelPlugin()
                    theirs = ""
                except Exception as exc:  # noqa: BLE001 - a name torch's enums lack is a KeyError: not our subject
                    theirs = str(exc)
            try:
                configs.parse_accelerate({"distributed_type": "FSDP",
                                          "fsdp_config": {"fsdp_version": version, key: "maybe"}})  # fmt: skip
                ours = ""
            except OrchError as exc:
                ours = str(exc)
            assert ("invalid truth value maybe" in theirs) == ("invalid truth value maybe" in ours), (version, key)
    for word in ("yes", "true", "1", "on", "false"):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", word)  # what `accelerate launch` sets
        config = configs.parse_accelerate({"distributed_type": "DEEPSPEED",
                                           "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": word}})
        assert config.zero3_save_16bit_model is DeepSpeedPlugin(zero_stage=3).zero3_save_16bit_model, word


@pytest.mark.unit
def test_a_json_accelerate_would_stop_on_is_one_line(tmp_path):
    accel = write(tmp_path, {})
    with pytest.raises(OrchError, match=r"^Accelerate config accel.yaml: deepspeed_config_file ds.json: no "
                                        r"zero_optimization mapping, which accelerate requires"):  # fmt: skip
        configs.load_accelerate(accel, tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(OrchError, match=r"^DeepSpeed JSON \S+/ds.json is not valid JSON \(line 1: "):
        configs.load_accelerate(accel, tmp_path)
    (tmp_path / "ds.json").unlink()
    with pytest.raises(OrchError, match=r"^Accelerate config accel.yaml: deepspeed_config_file ds.json is not a file "
                                        r"in the workdir: accelerate reads it on the nodes"):  # fmt: skip
        configs.load_accelerate(accel, tmp_path)
    config = yaml.safe_load((tmp_path / "accel.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = "x" * 300  # no file name: nor JSON, nor base64 of it
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(OrchError, match=r"^Accelerate config long.yaml: deepspeed_config_file x{300} is not a file in"):
        configs.load_accelerate("long.yaml", tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": "three"}}')
    with pytest.raises(OrchError, match=r"zero_optimization.stage='three' is not a whole number"):
        configs.load_accelerate(accel, tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": -1}}')
    with pytest.raises(OrchError, match=r"zero_optimization.stage=-1 is not a ZeRO stage: DeepSpeed's are 0, 1, 2 "):
        configs.load_accelerate(accel, tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "CPU"}}}')
    with pytest.raises(OrchError, match=r"zero_optimization.offload_param.device='CPU' is not an offload device: "
                                        r"DeepSpeed's are none, cpu, nvme"):  # a JSON reaches DeepSpeed as written
        configs.load_accelerate(accel, tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": "auto"}}')  # accelerate's plugin fills in 2
    assert configs.load_accelerate(accel, tmp_path)[0].zero_stage == 2
    (tmp_path / "ds.json").write_text('{"zero_optimization": {}}')  # DeepSpeed's own default: the rehearsal says
    assert configs.load_accelerate(accel, tmp_path)[0].zero_stage is None
    config = yaml.safe_load((tmp_path / "accel.yaml").read_text())
    config["distributed_type"] = "MULTI_GPU"  # accelerate reads no DeepSpeed settings then: neither does orch
    (tmp_path / "accel.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "ds.json").unlink()
    assert configs.load_accelerate(accel, tmp_path)[0].deepspeed_json is None


@pytest.mark.unit
def test_zero3_json_without_gathering_is_refused_with_the_jsons_own_fix(tmp_path):
    from orchestrator.node.rules import check_final_model_is_written

    config, _ = configs.load_accelerate(write(tmp_path, JSONS["stage 3, the optimizer offloaded, not gathered"]),
                                        tmp_path)  # fmt: skip
    with pytest.raises(OrchError, match=r"^accel.yaml: ZeRO-3 without 16-bit gathering on save writes the final "
                                        r"model as a DeepSpeed checkpoint that transformers cannot load; set "
                                        r"zero_optimization\.stage3_gather_16bit_weights_on_model_save: true in its "
                                        r"DeepSpeed JSON \(ds.json\)$"):  # fmt: skip
        check_final_model_is_written(config, "accel.yaml")
    config, _ = configs.load_accelerate(write(tmp_path, JSONS["stage 3, everything offloaded, gathered"]), tmp_path)
    check_final_model_is_written(config, "accel.yaml")


def json_copy(project, name: str, **zero) -> None:
    """`orch cp llama3_sft_zero3 NAME` with its ZeRO settings moved into a DeepSpeed JSON."""
    assert orch("cp", "llama3_sft_zero3", name, cwd=project).returncode == 0
    accel_path = project / "recipes" / "accelerate" / f"{name}.yaml"
    accel = yaml.safe_load(accel_path.read_text())
    ds = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, **zero},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}  # fmt: skip
    (project / "recipes" / "accelerate" / f"{name}.json").write_text(json.dumps(ds, indent=1))
    accel["deepspeed_config"] = {"deepspeed_config_file": f"recipes/accelerate/{name}.json",
                                 "deepspeed_multinode_launcher": "standard", "zero3_init_flag": True}  # fmt: skip
    accel.pop("mixed_precision")
    accel_path.write_text("# my ZeRO-3, settings in the JSON\n" + yaml.safe_dump(accel))


@pytest.mark.cli
def test_the_launch_plans_memory_load_and_disk_by_the_json(project):
    json_copy(project, "z3_json", offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    assert orch("cp", "llama3_sft_zero3", "z3_inline", cwd=project).returncode == 0  # the same, inline
    inline = project / "recipes" / "accelerate" / "z3_inline.yaml"
    config = yaml.safe_load(inline.read_text())
    config["deepspeed_config"].update(offload_param_device="cpu", offload_optimizer_device="cpu")
    inline.write_text(yaml.safe_dump(config))
    planned = {}
    for name in ("z3_json", "z3_inline"):
        done = orch("run", name, "--secret", "HF_TOKEN=x", "--dry-run", "--skip-optimizer", "--gpus", "A100-80GB:8",
                    cwd=project)
        assert done.returncode == 0, done.stderr
        planned[name] = [re.sub(r"orch-[\w-]+-checkpoints|orch-[\w-]+-[0-9a-f]{8}", "BUCKET", line)
                         for line in done.stdout.splitlines() if line.startswith(("memory", "disk"))]  # fmt: skip
    assert planned["z3_json"] == planned["z3_inline"], planned
    assert "under ZeRO-3 with CPU offload on 8 GPUs" in planned["z3_json"][0]
    assert "rank 0 alone reads the checkpoint" in planned["z3_json"][1]


@pytest.mark.cli
def test_a_copy_gets_its_own_json_and_never_overwrites_anothers(project):
    json_copy(project, "z3_json")
    done = orch("cp", "z3_json", "mine", cwd=project)
    assert done.returncode == 0, done.stderr
    accel = project / "recipes" / "accelerate"
    assert "wrote recipes/accelerate/mine.json" in done.stdout.splitlines()
    assert (accel / "mine.yaml").read_text().startswith("# my ZeRO-3, settings in the JSON\n")  # the text kept
    config, _ = configs.load_accelerate("recipes/accelerate/mine.yaml", project)
    assert config.deepspeed_config_file == "recipes/accelerate/mine.json"
    assert (accel / "mine.json").read_text() == (accel / "z3_json.json").read_text()
    (accel / "other.json").write_text((accel / "z3_json.json").read_text())
    yaml_text = (accel / "z3_json.yaml").read_text().replace("z3_json.json", "other.json")
    (accel / "z3_json.yaml").write_text(yaml_text)  # z3_json now names other.json: a copy named `other` must not
    refused = orch("cp", "mine", "other", "--force", cwd=project)
    assert refused.returncode == 2 and refused.stderr.startswith(
        "orch: error: recipes/accelerate/other.json is the DeepSpeed JSON of z3_json: a copy must not overwrite it"
    ), refused.stderr
    assert not (project / "recipes" / "other.yaml").exists()


@pytest.mark.unit
def test_an_edit_of_a_file_the_configs_name_is_a_new_rehearsal(tmp_path):
    """The cache key held the Accelerate and TRL configs' own bytes only: an edited DeepSpeed JSON, chat template or
    local reward module met the old result."""
    from orchestrator.rehearsal import driver

    write(tmp_path, JSONS["stage 1, autos"])
    (tmp_path / "trl.yaml").write_text("chat_template_path: templates/chat.jinja\nreward_funcs: [accuracy_reward]\n")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{{ messages }}")
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text("def length(**kw): return [0.0]\n")
    argv = ["accelerate", "launch", "--config_file", "accel.yaml", "-m", "orchestrator.train", "grpo", "--config",
            "trl.yaml", "--reward_funcs", "accuracy_reward", "rewards.mine.length", "--seed", "1"]  # fmt: skip
    batch = driver.roles_batch("grpo", [driver.Role("head", argv)], [], 8)

    keys = [driver.cache_key(batch, tmp_path)]
    for path, text in (("ds.json", json.dumps(JSONS["stage 2 on nvme"])), ("templates/chat.jinja", "{{ x }}"),
                       ("rewards/mine.py", "def length(**kw): return [1.0]\n")):  # fmt: skip
        (tmp_path / path).write_text(text)
        keys.append(driver.cache_key(batch, tmp_path))
    assert len(set(keys)) == len(keys)
    (tmp_path / "unrelated.txt").write_text("x")
    assert driver.cache_key(batch, tmp_path) == keys[-1]


@pytest.mark.unit
def test_a_tokenizer_folder_beside_a_models_weights_is_keyed_without_reading_the_weights(tmp_path, monkeypatch):
    """chat_template_path may name a tokenizer's folder, which may be a model's: its weights are keyed by size and time,
    not read at every dry run."""
    from pathlib import Path

    from orchestrator.rehearsal import driver

    model = tmp_path / "my-model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    with open(model / "model.safetensors", "wb") as weights:
        weights.truncate(3 << 30)  # 3 GiB, sparse
    (tmp_path / "trl.yaml").write_text(f"chat_template_path: {model}\n")
    argv = ["accelerate", "launch", "-m", "orchestrator.train", "sft", "--config", "trl.yaml"]
    batch = driver.roles_batch("sft", [driver.Role("head", argv)], [], 8)
    read, real = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or real(self))
    first = driver.cache_key(batch, tmp_path)
    assert "tokenizer_config.json" in read and "model.safetensors" not in read
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ other }}"}')
    second = driver.cache_key(batch, tmp_path)
    with open(model / "model.safetensors", "r+b") as weights:
        weights.truncate(2 << 30)
    assert len({first, second, driver.cache_key(batch, tmp_path)}) == 3
    # a FIFO or a device is keyed as one, never read (a read of a FIFO waits for a writer, /dev/zero never ends)
    import os
    import threading

    os.mkfifo(model / "pipe")
    (tmp_path / "trl.yaml").write_text(f"chat_template_path: {model}\nreward_funcs: [dev.zero.f]\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "zero.py").symlink_to("/dev/zero")
    keyed: list[str] = []
    worker = threading.Thread(target=lambda: keyed.append(driver.cache_key(batch, tmp_path)), daemon=True)
    worker.start()
    worker.join(60)
    assert keyed and "pipe" not in read and "zero.py" not in read


@pytest.mark.e2e
def test_a_config_blocks_keys_become_the_launch_arguments_accelerates_launcher_makes_of_them(tmp_path):
    """accelerate's launcher prefixes fsdp_config's, fp8_config's and dynamo_config's keys that lack the block's word
    and takes the others as written: `offload_params: true` is FSDP offload on the nodes (orch planned none), and a
    parallelism_config `cp_size` is dropped (orch took it for parallelism_config_cp_size and said nothing)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from orchestrator.core.accelerate_schema import BLOCKS, launch_name

    blocks = {"fsdp_config": {"fsdp_version": 2, "offload_params": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdpx_odd": 1},
              "parallelism_config": {"cp_size": 2, "parallelism_config_dp_shard_size": 1},
              "dynamo_config": {"backend": "NO", "dynamo_mode": "default"},
              "fp8_config": {"backend": "TE", "fp8_format": "HYBRID"}}  # fmt: skip
    assert set(blocks) <= set(BLOCKS)
    (tmp_path / "accel.yaml").write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE",
                                                         "distributed_type": "FSDP", "num_machines": 1,
                                                         "num_processes": 2, **blocks}))  # fmt: skip
    args = launch_command_parser().parse_args(["--config_file", str(tmp_path / "accel.yaml"), "train.py"])
    result = _validate_launch_command(args)
    args = result[0] if isinstance(result, tuple) else result
    for block, keys in blocks.items():
        for key, value in keys.items():
            assert getattr(args, launch_name(block, key)) == value, (block, key)  # the argument accelerate set
    config = configs.parse_accelerate({"distributed_type": "FSDP", "fsdp_config": blocks["fsdp_config"]})
    assert config.fsdp_offload_params is True and config.fsdp_version == 2
    from orchestrator.core import disk_need  # the checkpoint layout the disk check plans, by the same names

    unprefixed = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT"}}
    assert disk_need.state_dict_type(configs.parse_accelerate(unprefixed)) == "FULL_STATE_DICT"
