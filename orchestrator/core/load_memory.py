"""Peak memory while the model loads and is prepared, before the first step, per loading path (transformers 5.17,
accelerate 1.15, DeepSpeed 0.19, bitsandbytes 0.50, orch's train/loading.py): the host memory rank 0 and the other
ranks add, the busiest node's, and the per-GPU peak. core/fit.py checks them; tests/test_load_memory.py measures them
on CPU."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.memory import (
    DTYPE_BYTES,
    GIB,
    NF4_BYTES,
    Setup,
    builds_reference,
    ds_bucket,
    states,
    trained_params,
)


@dataclass(frozen=True)
class LoadMemory:
    """Peak memory while the model loads and is prepared (sharded, wrapped), before the first step, in bytes."""

    path: str
    """How the ranks load, in words."""
    rank0: float
    """Host memory rank 0 adds over its pre-load resident set: the checkpoint it reads (through mmap: page cache,
    counted in its resident set once touched) plus any copy it makes (fp32 upcast)."""
    other: float
    """The same for every other rank."""
    node: float
    """Host memory of the busiest node (rank 0's): the checkpoint's pages once (a node's ranks share the page cache)
    plus every rank's own copies."""
    gpu: float
    """Per-GPU peak during loading (4-bit: each rank quantises the whole model onto its own GPU, and under FSDP2 makes
    its shard beside it in prepare)."""
    fix: str = ""
    """The Accelerate setting that would load with less host memory, where orch accepts it for this run."""

    def describe(self) -> str:
        ranks = f"rank 0 +{self.rank0 / GIB:.1f} GiB, each other rank +{self.other / GIB:.1f} GiB"
        node, gpu = self.node / GIB, self.gpu / GIB
        return f"~{node:.1f} GiB host memory on the busiest node ({ranks}), ~{gpu:.1f} GiB per GPU: {self.path}"


def at_load(setup: Setup, gpus_per_node: int, cpu_ram_efficient: bool, fsdp_version: int = 2, zero3_init: bool = True,
            params_on_host: bool = False) -> LoadMemory:  # fmt: skip
    """Host and GPU memory while loading, for the path the recipe's configs take (transformers 5.17, accelerate 1.15,
    DeepSpeed 0.19, bitsandbytes 0.50, orch's train/loading.py): `zero3_init` is the Accelerate config's
    zero3_init_flag (accelerate's default: on for ZeRO-3), `params_on_host` DeepSpeed's offload_param_device: cpu.
    tests/test_load_memory.py checks the FSDP2 and ZeRO-3 host figures against the resident sets measured on CPU."""
    a = setup.arch
    dtype = DTYPE_BYTES[setup.weights_dtype]
    read = a.params * dtype  # the checkpoint in the load dtype (and transformers' zero-filled copy of it)
    trained = trained_params(setup)
    if setup.method == "qlora":
        quantised = a.layers * a.layer_linear_params * NF4_BYTES[setup.nested_quant] + a.other_params * 2
        # FSDP2's prepare makes each rank's shard while accelerate still holds the whole model's state dict: measured
        # on one H100 (+117.5 MiB for 121.0 MiB of 4-bit weights, docs/gpu.md) and on 2 CPU ranks (+41-50 MiB per
        # rank for 83.5, tests/test_load_memory.py)
        shard = quantised / setup.gpus if setup.strategy == "fsdp" else 0.0
        return LoadMemory("4-bit: every rank quantises the whole model onto its own GPU (bitsandbytes; accelerate's "
                          "CPU-RAM-efficient loading skips 4-bit parameters)" + (", then FSDP2 shards it beside the "
                          "whole" if shard else ""), read, read, read, quantised + shard + trained * 4)  # fmt: skip
    held = states(setup)
    shard = held["weights"] + held["frozen weights"]
    if setup.strategy == "fsdp":
        upcast = trained * 4 if setup.mixed_precision and dtype < 4 else 0
        fp32 = " and upcasts the trained weights to fp32" if upcast else ""
        if cpu_ram_efficient and fsdp_version == 2:  # orch builds the others in never-written memory (loading.py)
            return LoadMemory(f"FSDP2, CPU-RAM-efficient: rank 0 reads the checkpoint{fp32}; every other rank "
                              "holds its parameters in never-written memory until rank 0's broadcast",
                              read + upcast, 0, read + upcast, shard)  # fmt: skip
        if cpu_ram_efficient:  # FSDP1: transformers 5 fills the others' parameters with zeros on CPU
            return LoadMemory("FSDP1, CPU-RAM-efficient: rank 0 reads the checkpoint, every other rank holds "
                              "transformers' zero-filled copy until FSDP's sync_module_states", read + upcast, read,
                              read + upcast + (gpus_per_node - 1) * read, shard)  # fmt: skip
        # node/rules.check_reference_model_loading refuses loading on rank 0 alone with a reference model under FSDP2
        refused = fsdp_version == 2 and builds_reference(setup)  # (TRL shards it without the broadcast)
        how = (f"not on rank 0 only: {setup.trainer.upper()}'s reference model needs every rank to read it" if refused
               else "fsdp_cpu_ram_efficient_loading: true loads it on rank 0 only")  # fmt: skip
        return LoadMemory(f"FSDP: every rank reads the whole checkpoint{fp32} before sharding ({how})", read + upcast,
                          read + upcast, read + gpus_per_node * upcast, shard, fix="" if refused else
                          "fsdp_cpu_ram_efficient_loading: true in the Accelerate config (rank 0 alone reads it)")
    if setup.strategy == "zero3" and zero3_init:
        # transformers' _load_state_dict_into_zero3_model: every rank maps the checkpoint, rank 0 alone copies from it
        # into each module's parameters, gathered one module at a time (GatheredParameters(modifier_rank=0)), and
        # zero.Init partitions them again: the other ranks never touch the mapped pages
        part = a.params * dtype / setup.gpus
        widest = max(a.vocab * a.hidden, *(i * o for i, o in a.linears().values())) * dtype
        host = part if params_on_host else 0.0
        where = "in host memory (offload_param_device: cpu)" if params_on_host else "on its GPU"
        on_gpu = 0.0 if params_on_host else part
        return LoadMemory(f"ZeRO-3 with deepspeed.zero.Init: rank 0 alone reads the checkpoint, one module gathered at "
                          f"a time; every rank keeps its partition {where}", read + host, host,
                          read + gpus_per_node * host,
                          max(on_gpu + widest, zero3_prepared(setup, on_gpu, held)))  # fmt: skip
    if setup.strategy == "zero3":
        return LoadMemory("ZeRO-3 without zero3_init_flag: every rank reads the whole checkpoint; DeepSpeed partitions "
                          "it when it initializes", read, read, read,
                          zero3_prepared(setup, a.params * dtype / setup.gpus, held))  # fmt: skip
    return LoadMemory("every rank reads the whole checkpoint and moves it to its GPU", read, read, read, read)


def zero3_prepared(setup: Setup, partition: float, held: dict[str, float]) -> float:
    """Per-GPU bytes at the end of ZeRO-3's initialize, in accelerate's prepare: the bf16 partition (`partition`, 0 with
    offload_param_device: cpu), the fp32 master partition and the gradient partition of the trained parameters (4 + 2
    bytes each over the ranks; in host memory with CPU offload), a full fine-tune's reference model's partition, and the
    gradient bucket. Adam's moments come at the first step. tests/test_ds_bucket.py reads it from DeepSpeed on CPU:
    8 bytes a parameter over 2 ranks, plus the bucket, for a full fine-tune."""
    optimizer = 0.0 if setup.offload else trained_params(setup) * 6 / setup.gpus
    reference = held["frozen weights"] if setup.method == "full" else 0.0  # LoRA's frozen base is in `partition`
    return partition + optimizer + reference + ds_bucket(setup)
