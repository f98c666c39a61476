"""The help accelerate needs for real FSDP2 and DeepSpeed on CPU (orchestrator/train/cpu_fsdp.py, the launcher's
`--ddp_backend gloo`) rests on accelerate's behaviour measured here. If a new accelerate changes it, these fail and
say what to do, instead of smoke runs quietly training something else."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, free_port

from orchestrator.core import strategy
from orchestrator.node import env as node_envs
from orchestrator.node import launcher

pytestmark = pytest.mark.unit

PROBE = ROOT / "tests" / "accelerate_probe.py"


def probe(mode: str, world: int) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(PROBE), mode]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=300)
        lines = [x for x in text.splitlines() if x.startswith("PROBE ")]
        assert proc.returncode == 0 and lines, text[-3000:]
        out.append(json.loads(lines[0][6:]))
    return out


@pytest.mark.e2e
def test_accelerate_alone_ignores_fsdp_on_cpu_and_the_help_makes_it_fsdp2():
    (alone,) = probe("fsdp", 1)
    assert alone["distributed_type"] == "MULTI_CPU" and alone["dtensor"] == 0, (
        "accelerate now runs FSDP on CPU by itself: delete orchestrator/train/cpu_fsdp.py and its call in entry.py"
    )
    (helped,) = probe("fsdp-helped", 1)
    assert helped["distributed_type"] == "FSDP", "cpu_fsdp.install() no longer yields an FSDP state: see its docstring"
    assert helped["dtensor"] == 4, "accelerate's FSDP2 prepare did not shard the parameters (fully_shard: DTensor)"


@pytest.mark.e2e
def test_deepspeed_world_size_mismatch_comes_from_partialstate_without_a_backend():
    # Without a backend, PartialState calls the run "no distributed training" (1 process) while DeepSpeed's comm
    # initialised gloo over both ranks: the "train_batch_size ... 4 != 4 * 1 * 2" of DeepSpeed on CPU.
    for report in probe("ds", 2):
        assert report["num_processes"] == 1 and report["deepspeed_world_size"] == 2, (
            f"accelerate now agrees with DeepSpeed on CPU without a backend ({report}): orch's --ddp_backend gloo "
            "for DeepSpeed on CPU (orchestrator/node/launcher.py) may be dropped"
        )
    for report in probe("ds-gloo", 2):
        assert report == {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_world_size": 2,
                          "shm_comm": False}  # fmt: skip


FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
ZERO1 = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}}
ZERO3 = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True}}
ZERO3_OFFLOAD = {**ZERO3, "deepspeed_config": {**ZERO3["deepspeed_config"], "offload_optimizer_device": "cpu"}}
CPU_REAL = [
    (FSDP2, "FSDP2 over gloo", "--use_cpu"),
    (ZERO1, "DeepSpeed ZeRO-1 over gloo", "--ddp_backend"),
    (ZERO3, "DeepSpeed ZeRO-3 over gloo", "--ddp_backend"),
    (ZERO3_OFFLOAD, "DeepSpeed ZeRO-3 over gloo", "--ddp_backend"),
]


@pytest.mark.parametrize("config, runs_as, switch", CPU_REAL, ids=["fsdp2", "zero1", "zero3", "zero3-offload"])
def test_sharded_strategies_keep_their_config_on_cpu(node_env, config, runs_as, switch):
    from orchestrator.node import plan

    env = node_env(2, 1, 1, ORCH_DEVICE="cpu", ACCELERATE_CONFIG="recipes/accelerate/mine.yaml")
    p = plan.plan(env, config, {"per_device_train_batch_size": 4})
    assert p.runs_as == runs_as
    # only CPU Adam is compiled, and only for offload: the shared-memory op is skipped (train/cpu_deepspeed.py)
    assert list(p.notes) == (["DeepSpeed compiles CPU Adam (ZeRO offload) on first use: a minute or two once, then "
                              "cached in ~/.cache/torch_extensions"] if config is ZERO3_OFFLOAD else [])  # fmt: skip
    argv = p.argv
    assert argv[argv.index("--config_file") + 1] == "recipes/accelerate/mine.yaml"
    assert argv[argv.index("--mixed_precision") + 1] == "no" and "--multi_gpu" not in argv
    assert argv[-2:] == [switch, "gloo" if switch == "--ddp_backend" else "true"]
    if "DEEPSPEED" in runs_as.upper():
        assert argv[argv.index("--deepspeed_multinode_launcher") + 1] == "standard"
        assert argv.index("--gradient_accumulation_steps") < argv.index("--module")


SP2 = {"parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed"}
FALLBACK = [
    ({"fsdp_config": {"fsdp_version": 2}, "parallelism_config": {"parallelism_config_cp_size": 2}}, "ring attention"),
    ({**ZERO3, "parallelism_config": SP2}, "sp_size=2 needs a multiple of 2 processes and this run has 3"),
    ({"fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True}}, "offload"),
    ({"fsdp_config": {"fsdp_version": 1}}, "FSDP1"),
]


@pytest.mark.parametrize("config, reason", FALLBACK, ids=["cp", "sp", "fsdp-offload", "fsdp1"])
def test_what_cannot_run_on_cpu_falls_back_to_ddp_and_says_why(node_env, config, reason):
    from orchestrator.core.configs import CPU_CONFIG
    from orchestrator.node import plan

    config = {"distributed_type": "FSDP", **config}
    env = node_env(3, 1, 0, ORCH_DEVICE="cpu", GLOBAL_BATCH_SIZE="12")
    p = plan.plan(env, config, {"per_device_train_batch_size": 4})
    assert p.runs_as == "DDP over gloo"
    assert p.argv[p.argv.index("--config_file") + 1] == str(CPU_CONFIG) and p.argv[-2:] == ["--use_cpu", "true"]
    (note,) = p.notes
    assert reason in note and "DDP over gloo instead" in note, note
    assert strategy.cpu_fallback(strategy.of(config), 3) is not None


def test_ulysses_keeps_its_sequence_parallel_size_on_cpu(node_env):
    from orchestrator.node import plan

    env = node_env(2, 1, 0, ORCH_DEVICE="cpu", GLOBAL_BATCH_SIZE="8")
    p = plan.plan(env, {**ZERO3, "parallelism_config": SP2}, {"per_device_train_batch_size": 1, "max_length": 64})
    assert p.runs_as == "DeepSpeed ZeRO-3 over gloo"
    argv = p.argv
    assert argv[argv.index("--parallelism_config_sp_size") + 1] == "2"
    assert argv[argv.index("--parallelism_config_dp_shard_size") + 1] == "1"
    assert p.data_parallel_size == 1 and p.gradient_accumulation_steps == 8


def test_gpu_launch_is_untouched_by_the_cpu_switches(node_env):
    config = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
    trainers = node_envs.from_env(node_env(2, 8, 0))
    flags = launcher.flags(config, ROOT / "x.yaml", "x.yaml", "gpu", trainers, "29500", None, 1)
    assert flags.runs_as == "FSDP" and not flags.script_args and "--mixed_precision" not in flags.argv


RAM_EFFICIENT = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": True}}


@pytest.mark.parametrize(
    "trainer, settings, refused",
    [
        ("dpo", {}, True),
        ("kto", {}, True),
        ("grpo", {"beta": 0.04}, True),
        ("grpo", {"beta": 0.0}, False),
        ("dpo", {"use_peft": True}, False),
        ("dpo", {"precompute_ref_log_probs": True}, True),  # TRL builds one for the precompute under FSDP
        ("kto", {"precompute_ref_log_probs": True}, True),
        ("sft", {}, False),
    ],
)
def test_reference_model_with_cpu_ram_efficient_loading_is_refused(trainer, settings, refused):
    # Found by running FSDP2 for real on CPU: 1 node x 2 processes, DPO's reference model empty on rank 1.
    from orchestrator.core.errors import OrchError
    from orchestrator.node import rules

    check = lambda: rules.check_reference_model_loading(trainer, RAM_EFFICIENT, settings, "a.yaml")  # noqa: E731
    if refused:
        with pytest.raises(OrchError, match=r"set fsdp_config.fsdp_cpu_ram_efficient_loading: false"):
            check()
    else:
        check()
    fsdp1 = {**RAM_EFFICIENT, "fsdp_config": {**RAM_EFFICIENT["fsdp_config"], "fsdp_version": 1}}
    rules.check_reference_model_loading(trainer, fsdp1, settings, "a.yaml")  # FSDP1 syncs module states
