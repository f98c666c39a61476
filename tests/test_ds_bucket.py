"""DeepSpeed's gradient bucket in the memory model (core/memory.ds_bucket), read back from DeepSpeed's own optimizer.

The first GPU run of `make gpu-check` (docs/gpu.md) measured 955.8 MiB of GPU memory at the end of accelerate's
prepare for the ZeRO-3 smoke run, whose model is 0.2 MiB: DeepSpeed's reduce bucket, reduce_bucket_size (5e8 elements
by default, never set by accelerate's DeepSpeed plugin) in bf16, which the memory model lacked for every ZeRO stage.
Here DeepSpeed builds each stage's engine on CPU from the config accelerate makes of an Accelerate config's
deepspeed_config (tests/ds_bucket.py bucket), and the bucket's bytes are read from its optimizer: ZeRO-3 holds it from
initialize on, ZeRO-1 and 2 during each backward."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import ROOT, free_port

from orchestrator.core import ds_buckets, load_memory, memory, models

pytestmark = pytest.mark.e2e  # imports DeepSpeed and builds three engines (~6 s)


def unbuilt(tmp_path) -> dict[str, str]:
    """The environment, with torch's extension builds in tmp_path/ops: DeepSpeed's comm on CPU JIT-builds its
    shared-memory op unless skipped (orchestrator/train/cpu_deepspeed.py), ~1 min of C++ a fresh environment."""
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}


def test_the_memory_model_counts_deepspeeds_gradient_bucket_as_deepspeed_allocates_it(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "ds_bucket.py"), "bucket", str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=unbuilt(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert not (tmp_path / "ops").exists(), "DeepSpeed built an op on CPU: ds_bucket.py lost its skip_shm_comm()"
    found = {int(s): (int(init), int(during)) for s, init, during in re.findall(r"^BUCKET (\d) (\d+) (\d+)$",
                                                                                 run.stdout, re.M)}  # fmt: skip
    assert sorted(found) == [1, 2, 3], run.stdout[-2000:]
    arch = models.arch_of("meta-llama/Llama-3.1-8B-Instruct")
    for stage, (at_init, during) in found.items():
        setup = memory.Setup(arch=arch, strategy=f"zero{stage}", gpus=8)
        assert memory.ds_bucket(setup) == during > 0, (stage, during)  # the step's peak holds it
        assert memory.estimate(setup).parts["gradient bucket"] * memory.GIB == during
        assert at_init == (during if stage == 3 else 0), (stage, at_init)
    # ZeRO-3 allocates it in prepare: the per-GPU figure at load holds it, on either loading path
    zero3 = memory.Setup(arch=arch, strategy="zero3", gpus=8)
    without = memory.Setup(arch=arch, strategy="fsdp", gpus=8)
    for init in (True, False):
        assert load_memory.at_load(zero3, 8, cpu_ram_efficient=False, zero3_init=init).gpu >= found[3][0]
    assert memory.ds_bucket(without) == 0 and memory.ds_bucket(memory.Setup(arch=arch, strategy="ddp")) == 0
    # a DeepSpeed JSON's own reduce_bucket_size: a number, or "auto", which transformers fills with hidden_size
    # squared (the memory model assumed DeepSpeed's 5e8 elements for every JSON: ~0.93 GiB where "auto" holds 32 MiB
    # for an 8B model)
    # and how many buckets: two with overlap_comm on ZeRO-1/2, none without contiguous_gradients
    jsons = re.findall(r"^JSONBUCKET (\{.*\}) (\d+) (\d+)$", run.stdout, re.M)
    assert len(jsons) == 7, run.stdout[-2000:]
    for settings, hidden, during in jsons:
        zero = json.loads(settings)
        small, ds, strategy = replace(arch, hidden=int(hidden)), {"zero_optimization": zero}, f"zero{zero['stage']}"
        setup = memory.Setup(arch=small, strategy=strategy, gpus=8,
                             reduce_bucket=ds_buckets.reduce_bucket_of(ds, small),
                             reduce_buckets=ds_buckets.buckets_of(ds, strategy))  # fmt: skip
        assert memory.ds_bucket(setup) == int(during), (zero, setup.reduce_bucket, setup.reduce_buckets, during)
    assert {int(during) for _, _, during in jsons} >= {0, 2 * 3000 * 2}  # both ends happened


def test_zero3s_load_figure_holds_what_its_initialize_adds_on_each_rank(tmp_path):
    """ZeRO-3's per-GPU figure at load (load_memory.zero3_prepared) against the bytes DeepSpeed's initialize adds on
    each of 2 ranks (tests/ds_bucket.py prepared): its bf16 partition, fp32 master and gradient partitions, 8 bytes a
    parameter over the ranks, plus the gradient bucket (the figure used to hold the bf16 partition alone)."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(ROOT / "tests" / "ds_bucket.py"), "prepared"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=unbuilt(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert not (tmp_path / "ops").exists(), "DeepSpeed built an op on CPU: ds_bucket.py lost its skip_shm_comm()"
    found = re.findall(r"^PREPARED (\d) (\d+) (\d+)$", run.stdout, re.M)
    assert len(found) == 2, run.stdout[-2000:]
    setup = memory.Setup(arch=models.arch_of("meta-llama/Llama-3.1-8B-Instruct"), strategy="zero3", gpus=2)
    held = memory.states(setup)
    partition = setup.arch.params * 2 / 2
    modelled = load_memory.zero3_prepared(setup, partition, held) - memory.ds_bucket(setup)
    per_param = modelled * 2 / setup.arch.params  # bytes a parameter, over the ranks
    for _rank, params, added in found:
        measured = (int(added) - memory.ds_bucket(setup)) * 2 / int(params)
        assert measured == pytest.approx(per_param, rel=0.02), (measured, per_param)
