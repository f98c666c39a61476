"""An Accelerate config, parsed once into what orch decides by (core/configs.py loads it; every module reads these
fields, never the mapping): the distributed type, mixed precision, FSDP's and DeepSpeed's settings that orch's rules,
the launcher, the memory model and the strategy label depend on, and the parallelism sizes. Booleans are read as
accelerate reads them from YAML (`true`, `"true"`, `True`); a block of the wrong type is one error line. `raw` keeps
the mapping as written, for the checks that hand it to accelerate's own names (core/accelerate_schema.py) and for
`orch show`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from orchestrator.core import parallel
from orchestrator.core.accelerate_schema import launch_name
from orchestrator.core.errors import OrchError
from orchestrator.core.overrides import truthy

_NONE = ("none", "", "None")


@dataclass(frozen=True)
class AccelerateConfig:
    distributed_type: str = "NO"
    """FSDP, DEEPSPEED, MULTI_GPU, NO, ... (upper-case, as accelerate's DistributedType names them)."""
    mixed_precision: str = "no"
    """no, bf16, fp16 or fp8 (lower-case)."""
    fsdp_version: int = 1
    fsdp_offload_params: bool = False
    fsdp_cpu_ram_efficient_loading: bool = False
    fsdp_activation_checkpointing: bool = False
    fsdp_wrap: str | None = None
    """fsdp_transformer_layer_cls_to_wrap: the decoder layer class(es) FSDP wraps, as written."""
    fsdp_state_dict_type: str | None = None
    """fsdp_state_dict_type (or `state_dict_type:`, the same launch argument), as written; None where not given."""
    zero_stage: int | None = None
    deepspeed_config_file: str = ""
    """A DeepSpeed JSON the config points at instead of inline settings: its ZeRO settings are read into the fields
    below where core/configs.py loads the config (with_deepspeed_json), as accelerate's DeepSpeed plugin reads them."""
    deepspeed_json: Mapping[str, object] | None = None
    """That JSON's settings, as accelerate reads them (None without one, or before with_deepspeed_json)."""
    zero3_save_16bit_model: bool = False
    zero3_init_flag: bool = True
    """deepspeed.zero.Init while the model is built (accelerate's default for ZeRO-3: on); read for stage 3 only."""
    offload_param_device: str = "none"
    offload_optimizer_device: str = "none"
    offload_param_nvme_path: str = "none"
    offload_optimizer_nvme_path: str = "none"
    """Where DeepSpeed swaps to with an offload device of nvme (accelerate's "none" where not given)."""
    parallelism: parallel.Sizes | None = None
    """parallelism_config's sizes as declared (refit to the real process count on the node), None without one."""
    sp_attn_implementation: str | None = None
    """parallelism_config_sp_attn_implementation: the core attention Ulysses wraps (accelerate's default: sdpa)."""
    raw: Mapping[str, object] = field(default_factory=dict)

    @property
    def fsdp(self) -> bool:
        return self.distributed_type == "FSDP"

    @property
    def deepspeed(self) -> bool:
        return self.distributed_type == "DEEPSPEED"

    @property
    def mixed(self) -> bool:
        """Mixed precision is on (bf16/fp16/fp8 compute over fp32 weights)."""
        return self.mixed_precision not in ("no", "none")

    @property
    def deepspeed_offload(self) -> bool:
        return any(d not in _NONE for d in (self.offload_param_device, self.offload_optimizer_device))

    @property
    def nvme_paths(self) -> dict[str, str]:
        """What DeepSpeed offloads to NVMe ("param", "optimizer") and where (accelerate's "none": no path given)."""
        return {part: path for part, device, path in (
            ("param", self.offload_param_device, self.offload_param_nvme_path),
            ("optimizer", self.offload_optimizer_device, self.offload_optimizer_nvme_path),
        ) if self.deepspeed and device.lower() == "nvme"}  # fmt: skip

    @property
    def deepspeed_param_offload(self) -> bool:
        """ZeRO-3's parameter partitions live in host memory (offload_param_device: cpu; nvme keeps only buffers)."""
        return self.offload_param_device.lower() == "cpu"

    @classmethod
    def of(cls, config: Mapping | AccelerateConfig, where: str = "the Accelerate config") -> AccelerateConfig:
        """The parsed config (a mapping is parsed; a parsed one is returned as it is)."""
        return config if isinstance(config, AccelerateConfig) else parse(config, where)


DEEPSPEED_JSON = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
"""The fields accelerate's DeepSpeedPlugin takes from a deepspeed_config_file (its plugin_to_config_mapping; the
Accelerate config's own values of them are refused beside a file, "will be ignored"), and the JSON keys they are."""


def json_value(config: Mapping, dotted: str) -> object:
    """A dotted key's value in a DeepSpeed JSON, None where absent or "auto" (accelerate's get_value, then its
    `config_value != "auto"`)."""
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return None if node == "auto" else node


ZERO_STAGES = (0, 1, 2, 3)
"""DeepSpeed's ZeRO stages (deepspeed.runtime.zero.config.ZeroStageEnum, which its DeepSpeedZeroConfig validates on the
nodes, after the model loaded; tests/test_deepspeed_json.py compares). accelerate passes any whole number on."""

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""DeepSpeed's offload devices (deepspeed.runtime.zero.offload_config.OffloadDeviceEnum; the same test compares): a
JSON's reach DeepSpeed as written, the Accelerate config's lowercased by `accelerate launch` (a null one left unset)."""

PLUGIN_STAGE = 2
"""The stage accelerate's DeepSpeedPlugin writes over a JSON's `"stage": "auto"` (its fill_match): its zero_stage,
`int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))`, a variable `accelerate launch` sets only from --zero_stage
or the Accelerate config's zero_stage, which orch refuses beside a JSON. A JSON without a stage is another matter: the
plugin fills nothing there and DeepSpeed runs its own default, so that stays unknown (None)."""


def with_deepspeed_json(config: AccelerateConfig, ds: Mapping, where: str) -> AccelerateConfig:
    """The config with what its DeepSpeed JSON decides (a DEEPSPEED config naming one): the ZeRO stage, the offload
    devices and ZeRO-3's 16-bit save, the plugin's defaults where the JSON has none or "auto" (a stage of "auto" is
    PLUGIN_STAGE's; one not given stays unknown, None). `where` names the file, for the one line a JSON accelerate
    refuses gets."""
    if not isinstance(ds, Mapping) or not isinstance(ds.get("zero_optimization"), Mapping):
        raise OrchError(f"{where}: no zero_optimization mapping, which accelerate requires (\"Please specify the ZeRO "
                        "optimization config in the DeepSpeed config.\"): add one with its stage")  # fmt: skip
    stage = json_value(ds, DEEPSPEED_JSON["zero_stage"])
    if stage is None and ds["zero_optimization"].get("stage") == "auto":
        stage = PLUGIN_STAGE
    return replace(
        config,
        zero_stage=None if stage is None else _stage(stage, "zero_optimization.stage", where),
        offload_optimizer_device=_device(json_value(ds, DEEPSPEED_JSON["offload_optimizer_device"]) or "none",
                                         DEEPSPEED_JSON["offload_optimizer_device"], where, str),
        offload_param_device=_device(json_value(ds, DEEPSPEED_JSON["offload_param_device"]) or "none",
                                     DEEPSPEED_JSON["offload_param_device"], where, str),
        offload_param_nvme_path=str(json_value(ds, DEEPSPEED_JSON["offload_param_nvme_path"]) or "none"),
        offload_optimizer_nvme_path=str(json_value(ds, DEEPSPEED_JSON["offload_optimizer_nvme_path"]) or "none"),
        zero3_save_16bit_model=truthy(json_value(ds, DEEPSPEED_JSON["zero3_save_16bit_model"]) or False),
        deepspeed_json=MappingProxyType(dict(ds)),
    )


def _block(config: Mapping, key: str, where: str) -> Mapping:
    value = config.get(key) or {}
    if not isinstance(value, Mapping):
        raise OrchError(f"{where}: {key} must be a mapping of settings, not a {type(value).__name__}")
    return value


def _int(value: object, key: str, where: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise OrchError(f"{where}: {key}={value!r} is not a whole number") from None


def _stage(value: object, key: str, where: str) -> int:
    stage = _int(value, key, where)
    if stage not in ZERO_STAGES:
        raise OrchError(f"{where}: {key}={value!r} is not a ZeRO stage: DeepSpeed's are "
                        f"{', '.join(map(str, ZERO_STAGES[:-1]))} and {ZERO_STAGES[-1]} (its DeepSpeedZeroConfig "
                        "refuses any other on the nodes, once the model has loaded)")  # fmt: skip
    return stage


def _device(value: object, key: str, where: str, as_read: Callable[[str], str]) -> str:
    """An offload device DeepSpeed takes, as `as_read` (str.lower for accelerate's launcher) hands it on."""
    text = str(value)
    if text in _NONE:
        return text
    if as_read(text) not in OFFLOAD_DEVICES:
        raise OrchError(f"{where}: {key}={value!r} is not an offload device: DeepSpeed's are "
                        f"{', '.join(OFFLOAD_DEVICES)} (its DeepSpeedZeroConfig refuses any other on the nodes, once "
                        "the model has loaded)")  # fmt: skip
    return as_read(text)


TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")
"""accelerate's str_to_bool (accelerate/utils/environment.py), which every rank applies to the FSDP flags and ZeRO-3's
init flag that `accelerate launch` passes on as `str(value).lower()`: any other word, a null included, is a ValueError
in every rank once the model has loaded (tests/test_deepspeed_json.py compares)."""


FSDP_FLAGS = {"fsdp_offload_params": (1, 2), "fsdp_cpu_ram_efficient_loading": (1, 2),
              "fsdp_activation_checkpointing": (1, 2), "fsdp_activation_checkpointing_offload": (1, 2),
              "fsdp_use_orig_params": (1,), "fsdp_sync_module_states": (1,), "fsdp_forward_prefetch": (1,),
              "fsdp_reshard_after_forward": (2,)}
"""The FSDP settings accelerate's FullyShardedDataParallelPlugin reads with str_to_bool, and the FSDP versions it reads
each for (FSDP1 takes reshard_after_forward as a sharding strategy's name; FSDP2 ignores the three FSDP1-only flags);
tests/test_deepspeed_json.py compares with the plugin itself."""


def _flag(value: object, key: str, where: str) -> bool:
    word = str(value).lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise OrchError(f"{where}: {key}={value!r} is not a boolean accelerate takes: use true or false "
                        f"(accelerate's str_to_bool stops every rank: \"invalid truth value {word}\")")  # fmt: skip
    return word in TRUE_WORDS


def parse(config: Mapping, where: str = "the Accelerate config") -> AccelerateConfig:
    """Parse an Accelerate config mapping (OrchError naming the key when a value has the wrong type)."""
    if not isinstance(config, Mapping):
        raise OrchError(f"{where} must be a YAML mapping of settings")
    fsdp = {launch_name("fsdp_config", str(k)): v for k, v in _block(config, "fsdp_config", where).items()}
    ds = _block(config, "deepspeed_config", where)
    sp_attn = _block(config, "parallelism_config", where).get("parallelism_config_sp_attn_implementation")
    stage = ds.get("zero_stage")
    distributed_type = str(config.get("distributed_type") or "NO").upper()
    deepspeed = distributed_type == "DEEPSPEED"  # accelerate reads the block only for DeepSpeed
    number = _stage if deepspeed else _int

    def device(value: object, key: str) -> str:
        return _device(value, key, where, str.lower) if deepspeed else str(value)

    version = _int(fsdp.get("fsdp_version", 1), "fsdp_config.fsdp_version", where)
    if distributed_type == "FSDP":  # accelerate passes the FSDP block on only for FSDP
        for key, versions in FSDP_FLAGS.items():
            if key in fsdp and version in versions:
                _flag(fsdp[key], f"fsdp_config.{key}", where)

    def fsdp_flag(key: str) -> bool:  # for FSDP, checked above
        value = fsdp.get(key, False)
        return str(value).lower() in TRUE_WORDS if distributed_type == "FSDP" else truthy(value)

    init = ds.get("zero3_init_flag")
    if init is None:  # unset, or null (accelerate's launcher leaves it out): ZeRO-3's own default
        init_flag = True
    else:
        init_flag = _flag(init, "deepspeed_config.zero3_init_flag", where) if deepspeed else truthy(init)
    save16 = ds.get("zero3_save_16bit_model", False)  # DeepSpeedPlugin: `.lower() == "true"`, a quoted "yes" is off
    save16_flag = str(save16).lower() == "true" if deepspeed else truthy(save16)

    return AccelerateConfig(
        distributed_type=distributed_type,
        mixed_precision=str(config.get("mixed_precision") or "no").lower(),
        fsdp_version=version,
        fsdp_offload_params=fsdp_flag("fsdp_offload_params"),
        fsdp_cpu_ram_efficient_loading=fsdp_flag("fsdp_cpu_ram_efficient_loading"),
        fsdp_activation_checkpointing=fsdp_flag("fsdp_activation_checkpointing"),
        fsdp_wrap=None if fsdp.get("fsdp_transformer_layer_cls_to_wrap") is None
        else str(fsdp["fsdp_transformer_layer_cls_to_wrap"]),
        fsdp_state_dict_type=str(fsdp["fsdp_state_dict_type"]) if fsdp.get("fsdp_state_dict_type") else None,
        zero_stage=None if stage in (None, "") else number(stage, "deepspeed_config.zero_stage", where),
        deepspeed_config_file=str(ds.get("deepspeed_config_file") or ""),
        zero3_save_16bit_model=save16_flag,
        zero3_init_flag=init_flag,
        offload_param_device=device(ds.get("offload_param_device", "none"), "deepspeed_config.offload_param_device"),
        offload_optimizer_device=device(ds.get("offload_optimizer_device", "none"),
                                        "deepspeed_config.offload_optimizer_device"),
        offload_param_nvme_path=str(ds.get("offload_param_nvme_path") or "none"),
        offload_optimizer_nvme_path=str(ds.get("offload_optimizer_nvme_path") or "none"),
        parallelism=parallel.declared(config),
        sp_attn_implementation=None if sp_attn in (None, "") else str(sp_attn),
        raw=MappingProxyType(dict(config)),
    )  # fmt: skip
