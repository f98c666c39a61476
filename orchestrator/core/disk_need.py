"""What a run writes on each node's disk, from the model's shape and the recipe (no torch import): the model's
download and a checkpoint's share per node, checked before launch against the nodes' disk (resources.disk_size).

A checkpoint holds the trained weights as the strategy holds them and the optimizer's state, written where the
libraries write them (accelerate 1.15, transformers 5.17, DeepSpeed 0.19, read from their code; the per-strategy
bytes are measured by tests/test_trainers_smoke.py on CPU for FSDP2 (fp32 and bf16 mixed precision), QLoRA under
FSDP2, DDP (fp32 and bf16), ZeRO-2 and ZeRO-3):

    DDP, FSDP's FULL_STATE_DICT   rank 0 writes the weights and the whole optimizer state (node 0)
    FSDP's SHARDED_STATE_DICT     every rank its shard of both (torch.distributed.checkpoint; FSDP2's default)
    ZeRO-1/2                      every rank its optimizer partition (fp32 master, m and v: 12 bytes a parameter);
                                  rank 0 the weights twice (transformers' model.safetensors, DeepSpeed's
                                  mp_rank_00_model_states.pt)
    ZeRO-3                        every rank its partition (12 bytes); rank 0 the gathered 16-bit model
                                  (zero3_save_16bit_model; without it none)
    PEFT                          the adapter and its optimizer state only (transformers saves no frozen weight)

Where it lands decides how many are on the disk at once: a checkpoint root on the node's own disk keeps
save_total_limit of them and writes the next whole before the oldest goes, plus the final model; a bucket mounted
MOUNT_CACHED passes each through rclone's cache on the node's disk (SkyPilot's flags: files are uploaded a second after
they close and evicted beyond 10 GB), so about one share at a time; a MOUNT bucket, a volume or a Slurm cluster's
shared file system keep nothing on it. train/disk.py measures the real figures at every save.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.core import memory, trainers
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.final_model import size_words
from orchestrator.core.optimizers import optim_bytes
from orchestrator.core.overrides import truthy

DEFAULT_DISK_GB = 256
"""SkyPilot's resources.disk_size when a task gives none (sky/resources.py DEFAULT_DISK_SIZE_GB)."""

GB = 1e9


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's bytes on each node's disk, by part (lists indexed by node)."""

    weights: list[float]
    optimizer: list[float]
    per_parameter: tuple[float, float]
    """Bytes a trained parameter takes: (weights, optimizer state), as the strategy holds them."""
    layout: str
    """Who writes what, in words."""

    def on(self, node: int) -> float:
        return self.weights[node] + self.optimizer[node]

    @property
    def total(self) -> float:
        return sum(self.weights) + sum(self.optimizer)


def per_parameter(setup: memory.Setup) -> tuple[float, float]:
    """(weights, optimizer state) bytes of a trained parameter in a checkpoint: core/memory.per_parameter's, except
    that DeepSpeed's weights take the module's dtype (bf16 under mixed precision) and its optimizer partition (QLoRA's
    too) is fp32 master and the optimizer's states on it whatever the weights' dtype (core/optimizers.py; torch.save
    writes them so: tests/test_optim_memory.py)."""
    if setup.strategy.startswith("zero") and setup.method != "lora":
        module: float = 2 if setup.mixed_precision else memory.DTYPE_BYTES[setup.weights_dtype]
        return module, 4 + optim_bytes(setup.optim, 4)
    weights, _, optimizer = memory.per_parameter(setup)
    return weights, optimizer


def trained_params(setup: memory.Setup) -> int:
    """memory.trained_params, less the LM head a reward model does not have (its score head is one column: the
    trainer's spec says it has no LM head)."""
    trained = memory.trained_params(setup)
    if not trainers.spec(setup.trainer).fused_head and setup.method == "full" and not setup.arch.tied:
        trained -= setup.arch.vocab * setup.arch.hidden - setup.arch.hidden
    return trained


def state_dict_type(accel: AccelerateConfig) -> str:
    """FSDP's checkpoint layout: the config's fsdp_state_dict_type, else accelerate's default (FSDP2: sharded)."""
    given = (accel.fsdp_state_dict_type or "").upper()
    if given:
        return given if given.endswith("_STATE_DICT") else f"{given}_STATE_DICT"
    return "SHARDED_STATE_DICT" if accel.fsdp_version == 2 else "FULL_STATE_DICT"


def checkpoint(setup: memory.Setup, nodes: int, accel: AccelerateConfig, settings: Mapping[str, object]) -> Checkpoint:
    """One checkpoint of this setup over `nodes` nodes (setup.gpus ranks, evenly split)."""
    trained = trained_params(setup)
    w, opt = per_parameter(setup)
    if truthy(settings.get("save_only_model") or False):
        opt = 0.0
    s = setup.strategy
    spread = [1 / nodes] * nodes
    head = [1.0] + [0.0] * (nodes - 1)
    if s == "fsdp" and state_dict_type(accel) == "SHARDED_STATE_DICT":
        weights, optimizer = [trained * w * f for f in spread], [trained * opt * f for f in spread]
        layout = f"every rank writing its shard (FSDP's sharded state dict, over {nodes} node(s))"
    elif s.startswith("zero"):
        copies = 0 if s == "zero3" and not (accel.zero3_save_16bit_model or setup.method != "full") else (
            1 if s == "zero3" or opt == 0 else 2)  # fmt: skip
        w *= copies
        weights = [trained * w * f for f in head]
        optimizer = [trained * opt * f for f in spread]
        written = {0: "none (no zero3_save_16bit_model)", 1: "the weights", 2: "the weights twice (transformers' "
                   "model.safetensors, DeepSpeed's model states)"}[copies]  # fmt: skip
        layout = f"every rank writing its ZeRO partition (over {nodes} node(s)), rank 0 {written}"
    else:
        weights, optimizer = [trained * w * f for f in head], [trained * opt * f for f in head]
        layout = "rank 0 writing it all"
    return Checkpoint(weights, optimizer, (w, opt), layout)


def stored_bytes(config: Mapping | None) -> int:
    """Bytes a weight takes in the model's files: config.json's dtype (torch_dtype before transformers 5), else bf16,
    as the recipes' models are stored."""
    text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), Mapping) else None
    for source in (config or {}, text or {}):
        named = source.get("dtype") or source.get("torch_dtype")
        if isinstance(named, str) and named in memory.DTYPE_BYTES and named != "auto":
            return memory.DTYPE_BYTES[named]
    return 2


@dataclass(frozen=True)
class Need:
    """What the fullest node's disk holds at once."""

    node: int
    download: float
    checkpoints: float
    kept: int
    final: float
    disk_gb: float
    where: str
    """Where the checkpoints go, in words."""
    ckpt: Checkpoint

    @property
    def total(self) -> float:
        return self.download + self.checkpoints + self.final

    @property
    def fits(self) -> bool:
        return self.total <= self.disk_gb * GB

    def parts(self) -> str:
        """What the node's disk holds at once, in words."""
        parts = [f"the model's download {size_words(self.download)}"] if self.download else []
        if self.checkpoints:
            w, opt = self.ckpt.per_parameter
            each = f"{w + opt:g} bytes a trained parameter" + (f" ({w:g} weights, {opt:g} optimizer)" if opt else "")
            kept = (f"{self.kept} checkpoints (save_total_limit {self.kept - 1}, and each next one written whole "
                    "before the oldest goes)" if self.kept > 1 else "a checkpoint")  # fmt: skip
            parts.append(f"{kept} {size_words(self.checkpoints)}: {each}, {self.ckpt.layout}")
        if self.final:
            parts.append(f"the final model {size_words(self.final)}")
        return "; ".join(parts) or "nothing orch can size"

    def describe(self) -> str:
        return (f"~{size_words(self.total)} on node {self.node}'s disk at most ({self.parts()}; checkpoints: "
                f"{self.where}) of disk_size {self.disk_gb:g} GB, besides the image, the environment and the "
                "datasets")  # fmt: skip


def final_bytes(setup: memory.Setup) -> float:
    """The final model node 0 writes: the whole model in the dtype it loaded in (train/checkpoints.py), an adapter
    for PEFT in PEFT's fp32 (TRL's bf16 for QLoRA)."""
    each = {"lora": 4, "qlora": 2}.get(setup.method, memory.DTYPE_BYTES[setup.weights_dtype])
    return trained_params(setup) * each


def need(setup: memory.Setup, nodes: int, accel: AccelerateConfig, settings: Mapping[str, object], *, medium: str,
         where: str, disk_gb: float, download_bytes: int | None, shared: bool = False) -> Need:  # fmt: skip
    """The fullest node's disk at its fullest. `medium`: "disk" (the checkpoint root on the node's own disk), "cache"
    (a bucket mounted MOUNT_CACHED) or "remote" (nothing on the node's disk); `download_bytes`: bytes a weight takes
    in the model's files, None where the nodes read the model from a path of their own; `shared`: the checkpoint root
    is a file system every node writes to (a Slurm cluster's home), which holds every node's share."""
    ckpt = checkpoint(setup, nodes, accel, settings)
    download = 0.0 if download_bytes is None else setup.arch.params * download_bytes
    final = final_bytes(setup)
    limit = str(settings.get("save_total_limit") or "")
    kept = int(limit) + 1 if medium == "disk" and limit.isdigit() and int(limit) > 0 else 1
    rows = []  # (node, checkpoints, final) on each node's disk
    for node in range(nodes):
        mine, share = (final if node == 0 else 0.0), (ckpt.total if shared else ckpt.on(node))
        if medium == "disk":
            rows.append((node, share * kept, mine))
        elif medium == "cache":
            rows.append((node, max(share, mine), 0.0))
        else:
            rows.append((node, 0.0, 0.0))
    node, held, last = max(rows, key=lambda row: (row[1] + row[2], -row[0]))
    return Need(node, download, held, kept if held else 0, last, disk_gb, where, ckpt)


def per_node_words(setups: list[tuple[int, memory.Setup]], stored: int) -> str:
    """`orch plan`'s disk line: what each planned shape's nodes hold at most, with the checkpoints on a bucket mounted
    MOUNT_CACHED as the recipes mount one (the model's download and one checkpoint's share in rclone's cache), under
    the Accelerate settings the recipes give each strategy (FSDP2's sharded state dict, TRL's ZeRO-3 16-bit save)."""
    shown: dict[str, str] = {}
    for nodes, setup in setups:
        stage = setup.strategy[4:] if setup.strategy.startswith("zero") else ""
        accel = AccelerateConfig.of(
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}} if setup.strategy == "fsdp" else
            {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": int(stage),
                                                                   "zero3_save_16bit_model": True}} if stage else
            {"distributed_type": "MULTI_GPU"})  # fmt: skip
        per_gpu = setup.gpus // nodes
        got = need(setup, nodes, accel, {}, medium="cache", where="", disk_gb=DEFAULT_DISK_GB, download_bytes=stored)
        shown.setdefault(f"{nodes} x {per_gpu}", f"~{size_words(got.total)}")
    return ", ".join(f"{shape} {words}" for shape, words in shown.items())


def disk_gb(resources: Mapping[str, object]) -> float:
    """resources.disk_size in GB (SkyPilot's default where unset); a ValueError for one that is not a number > 0."""
    raw = resources.get("disk_size")
    if raw is None:
        return float(DEFAULT_DISK_GB)
    value = float(str(raw))
    if not value > 0 or math.isinf(value):
        raise ValueError(raw)
    return value
