"""A precision the GPU has no tensor cores for is refused before launch (core/precision.py check_gpu): bf16 on a T4 or a
V100 passes every owner's check (torch.cuda.is_bf16_supported() counts emulation, and transformers asks it), then runs
emulated on the nodes the user pays for; fp8 needs compute capability 8.9. The launch side checks the named
accelerator, the head node its own GPUs (plain `sky launch`: tests/test_rehearsal.py), and a memory refusal offers
only accelerators the check takes."""

import itertools
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, orch

from orchestrator.core import cuda_arch, fit, precision
from orchestrator.core.accelerators import CUDA_CAPABILITY
from orchestrator.core.errors import OrchError

MIXED = ("no", "bf16", "fp16", "fp8")  # the Accelerate config's mixed_precision
FLAGS = ({}, {"bf16": True}, {"fp16": True}, {"bf16": False}, {"bf16": "true", "fp16": "false"})  # TRL's
DTYPES = ({}, {"dtype": "bfloat16"}, {"dtype": "float32"}, {"dtype": "float16"})


def refusal(settings: dict, mixed: str, gpu: str, envs: dict | None = None) -> str | None:
    try:
        precision.check_gpu(settings, mixed, CUDA_CAPABILITY[gpu], gpu, envs)
    except OrchError as exc:
        return str(exc)
    return None


@pytest.mark.unit
@pytest.mark.parametrize("gpu", sorted(CUDA_CAPABILITY))
def test_a_precision_is_refused_exactly_where_the_gpu_has_no_tensor_cores_for_it_and_the_fix_is_taken(gpu):
    capability = CUDA_CAPABILITY[gpu]
    for flags, dtype, mixed in itertools.product(FLAGS, DTYPES, MIXED):
        settings = {**flags, **dtype}
        runs = precision.compute(settings, mixed)
        bf16 = runs == "bf16" or dtype.get("dtype") == "bfloat16"
        expected = (bf16 and capability < (8, 0)) or (runs == "fp8" and capability < (8, 9))
        refused = refusal(settings, mixed, gpu)
        assert (refused is not None) == expected, (gpu, settings, mixed, refused)
        assert refusal(settings, mixed, gpu, {"ORCH_PRECISION_CHECK": "off"}) is None
        if refused is None:
            continue
        assert refused.startswith(f"{gpu} (compute capability {capability[0]}.{capability[1]}) has no ")
        assert refused.endswith("; ORCH_PRECISION_CHECK=off runs it anyway") and "\n" not in refused
        # the fix it names, applied as `orch run ... key=value` applies it, is one the check takes
        fix = re.search(r"; set ((?:\w+=\w+ ?)+)", refused).group(1).split()
        fixed = {**settings, **dict(pair.split("=") for pair in fix)}
        assert refusal(fixed, mixed, gpu) is None, (refused, fixed)
        assert precision.compute(fixed, mixed) in ("fp16", "bf16"), fixed  # mixed precision still, not fp32
    with pytest.raises(OrchError, match="ORCH_PRECISION_CHECK='maybe': ORCH_PRECISION_CHECK takes on or off"):
        precision.check_gpu({"bf16": True}, "no", capability, gpu, {"ORCH_PRECISION_CHECK": "maybe"})


@pytest.mark.unit
def test_without_a_compute_capability_nothing_is_refused():
    """CPU processes and AMD's MI300X (no CUDA capability; it runs bf16): nothing to check."""
    assert precision.check_gpu({"bf16": True, "dtype": "bfloat16"}, "fp8", None, "MI300X") is None
    assert precision.native_bf16("MI300X") and precision.native_bf16("a100") and not precision.native_bf16("T4")


@pytest.mark.unit
def test_a_memory_refusal_offers_only_an_accelerator_the_precision_check_takes():
    """The smallest GPU that holds a step of ~12-15 GiB is a T4, which has no bf16 tensor cores: a bf16 run is offered
    the next one that does (an L4), the same run in fp16 the T4; from the setup fit.setup_of makes of the recipe's
    settings and Accelerate config (bf16 from TRL's flags, the weights' dtype or the config). (The V100-32GB, which
    this test used, is refused for another reason now: tests/test_torch_build.py.)"""
    from orchestrator.core.accelerate_config import parse

    assert fit.smallest_holding(14) == "T4" and fit.smallest_holding(14, bf16=True) == "L4"
    model = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}
    for settings, accel, offered in (  # micro-batches of ~12-15 GiB a step (16-bit weights take less: more of them)
        ({"bf16": True, "dtype": "float32", "per_device_train_batch_size": 20}, {}, "L4 (24 GiB)"),
        ({"dtype": "bfloat16", "per_device_train_batch_size": 48}, {}, "L4 (24 GiB)"),
        ({"dtype": "float16", "per_device_train_batch_size": 48}, {}, "T4 (16 GiB)"),
        ({"dtype": "float32", "per_device_train_batch_size": 20}, {"mixed_precision": "bf16"}, "L4 (24 GiB)"),
        ({"fp16": True, "dtype": "float32", "per_device_train_batch_size": 20}, {"mixed_precision": "bf16"},
         "T4 (16 GiB)"),
        ({"dtype": "float32", "per_device_train_batch_size": 20}, {}, "T4 (16 GiB)"),
    ):
        setup = fit.setup_of("sft", {**model, **settings}, parse(accel), 1)
        # mixed precision as transformers hands it to the Accelerator: TRL's bf16/fp16 where true, else the config's
        assert setup.mixed_precision is ("bf16" in settings or "fp16" in settings or "mixed_precision" in accel)
        with pytest.raises(OrchError, match=re.escape(f"use {offered}; `orch plan` lists what fits")):
            fit.check_gpu(setup, 12, "a 12 GiB GPU")


READ_BACK = """
import itertools, json, os
from transformers import training_args  # the training stack first, then the fake GPU, as a rehearsal role does
from orchestrator.rehearsal import fake_gpu
fake_gpu.cuda(1)
fake_gpu.capability((8, 0))
from transformers import TrainingArguments
seen = {}
for mixed, flags in itertools.product(json.loads(os.environ["MIXED"]), json.loads(os.environ["FLAGS"])):
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed  # as `accelerate launch` sets it from the config
    args = TrainingArguments(output_dir=os.environ["OUT"], report_to="none", **flags)
    seen[mixed + " " + json.dumps(flags, sort_keys=True)] = args.mixed_precision
print(json.dumps(seen))
"""


@pytest.mark.e2e
def test_the_precision_orch_checks_is_the_one_transformers_gives_the_accelerator(tmp_path):
    """precision.compute() against transformers' own TrainingArguments (`mixed_precision`, which the Trainer hands its
    Accelerator), for every Accelerate mixed precision and TRL flag above."""
    flags = [{k: v in (True, "true") for k, v in f.items()} for f in FLAGS]
    env = {"MIXED": json.dumps(MIXED), "FLAGS": json.dumps(flags), "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", READ_BACK], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert len(seen) == len(MIXED) * len(FLAGS)
    for mixed, f in itertools.product(MIXED, flags):
        assert seen[mixed + " " + json.dumps(f, sort_keys=True)] == precision.compute(f, mixed), (mixed, f)


@pytest.mark.cli
def test_orch_run_refuses_bf16_on_a_t4_in_one_line_and_takes_the_fix_it_names(project):
    argv = ["run", "qwen25_sft_ddp", "--gpus", "T4:1", "--dry-run", "--skip-optimizer"]
    refused = orch(*argv, cwd=project)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == (
        "orch: error: T4 (compute capability 7.5) has no bf16 tensor cores (they start at compute capability 8.0: "
        "A100, A10G, L4 and newer): with bf16: true and dtype: bfloat16 torch would emulate bf16, slowly; set "
        "bf16=false fp16=true dtype=float32 (fp16 mixed precision over fp32 weights, as these GPUs train) or use an "
        "Ampere or newer GPU; ORCH_PRECISION_CHECK=off runs it anyway\n"
    )
    assert sorted(p.name for p in project.iterdir()) == ["recipes"]  # nothing written
    fixed = orch(*argv, "bf16=false", "fp16=true", "dtype=float32", cwd=project)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "--bf16 false --fp16 true --dtype float32" in fixed.stdout
    anyway = orch(*argv, "--env", "ORCH_PRECISION_CHECK=off", cwd=project)
    assert anyway.returncode == 0, anyway.stderr[-2000:]
    # the recipe's DDP config asks bf16 itself: bf16=false alone leaves it on (transformers reads it from accelerate)
    config_only = orch(*argv, "bf16=false", "dtype=float32", cwd=project)
    assert config_only.returncode == 2
    assert "with the Accelerate config's mixed_precision: bf16 torch would emulate bf16, slowly; set fp16=true (" in \
        config_only.stderr  # fmt: skip


@pytest.mark.cli
def test_orch_plan_lists_no_bf16_plan_on_a_gpu_without_bf16_and_plans_it_in_fp32_weights(plan):
    planned = plan("Qwen/Qwen2.5-0.5B-Instruct")
    assert planned.returncode == 0, planned.stderr
    rows = {line.split()[0]: line.split()[1:] for line in planned.stdout.splitlines()[2:] if "  " in line}
    for gpu in CUDA_CAPABILITY:  # (the V100s: no kernels in the nodes' torch at all, tests/test_torch_build.py)
        if cuda_arch.runs_lock(gpu):
            assert (rows[gpu][:3] == ["-", "none", "in"]) is (not precision.native_bf16(gpu)), (gpu, rows[gpu])
    assert "T4: no bf16 tensor cores (a launch there in bf16 is refused); --dtype float32 plans them for fp16 mixed " \
        "precision over fp32 weights\n" in planned.stdout  # fmt: skip
    fp32 = plan("Qwen/Qwen2.5-0.5B-Instruct", "--dtype", "float32")
    assert fp32.returncode == 0 and "no bf16" not in fp32.stdout
    assert re.search(r"^T4 +1 x 8 +DDP ", fp32.stdout, re.M), fp32.stdout
