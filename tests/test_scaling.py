"""Scale without changing the math: batch invariance, parallelism refit, preflight checks."""

import itertools
import json
import re
import socket
import sys
import threading
import time

import pytest
from conftest import orch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_local_run import check_demo_run

from orchestrator.core import batch, memory_fix, parallel
from orchestrator.core.errors import OrchError
from orchestrator.launch import preflight
from orchestrator.node import plan as node
from orchestrator.node import vllm as node_exec

pytestmark = pytest.mark.unit

CP = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_version": 2},
    "parallelism_config": {"parallelism_config_cp_size": 2, "parallelism_config_dp_shard_size": 4},
}
SP = {
    "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True},
    "parallelism_config": {"parallelism_config_sp_size": 2, "parallelism_config_dp_shard_size": 4},
}
NODES = range(1, 65)
GPUS = (1, 2, 4, 8)


# ---------------------------------------------------------------- refit and batch math, 1..64 nodes x 1/2/4/8


@pytest.mark.parametrize("config, keep", [(CP, "cp"), (SP, "sp")])
def test_refit_for_every_cluster_shape(config, keep):
    declared = parallel.declared(config)
    for nodes, gpus in itertools.product(NODES, GPUS):
        total = nodes * gpus
        if total % 2:
            with pytest.raises(OrchError, match=rf"^{total} processes cannot be split into .* = 2; use a total GPU"):
                parallel.refit(declared, total)
            continue
        sizes = parallel.refit(declared, total)
        assert sizes.dp_replicate * sizes.dp_shard * sizes.cp * sizes.sp * sizes.tp == total
        assert getattr(sizes, keep) == 2 and sizes.dp_shard == total // 2
        assert sizes.data_parallel(total) == total // 2
        assert sizes.pad_multiple == (4 if keep == "cp" else 2)


def test_refit_keeps_tp_and_dp_replicate():
    sizes = parallel.Sizes(dp_replicate=2, tp=2, cp=2)
    assert parallel.refit(sizes, 64) == parallel.Sizes(dp_replicate=2, dp_shard=8, tp=2, cp=2)
    assert parallel.refit(sizes, 64).data_parallel(64) == 16
    with pytest.raises(OrchError, match=r"^12 processes cannot be split into dp_replicate 2 x cp 2 x sp 1 x tp 2 = 8"):
        parallel.refit(sizes, 12)


def test_batch_math_for_every_cluster_shape():
    for nodes, gpus in itertools.product(NODES, GPUS):
        total = nodes * gpus
        for per_device in (1, 2, 4):
            if 512 % (per_device * total):
                with pytest.raises(OrchError, match=r"^GLOBAL_BATCH_SIZE=512 is not a multiple of"):
                    batch.solve(512, per_device, total)
            else:
                assert per_device * total * batch.solve(512, per_device, total) == 512


def env(nodes, gpus, rank=0, **extra):
    base = {
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        "SKYPILOT_NODE_IPS": "".join(f"10.1.0.{i + 1}\n" for i in range(nodes)),
        "TRL_TRAINER": "sft",
        "TRL_CONFIG": "t.yaml",
        "ACCELERATE_CONFIG": "a.yaml",
        "GLOBAL_BATCH_SIZE": "32",
    }
    return {**base, **extra}


def test_node_plan_passes_refit_sizes_and_padding_and_uses_dp_for_batch():
    plan = node.plan(env(2, 8), CP, {"per_device_train_batch_size": 1})
    argv = " ".join(plan.argv)
    assert (
        "--parallelism_config_dp_replicate_size 1 --parallelism_config_dp_shard_size 8 "
        "--parallelism_config_tp_size 1 --parallelism_config_cp_size 2 --parallelism_config_sp_size 1"
    ) in argv
    assert "--pad_to_multiple_of 4" in argv
    assert plan.data_parallel_size == 8 and plan.gradient_accumulation_steps == 4  # 32 = 1 x 8 x 4, not 1 x 16 x 2
    sp = node.plan(env(1, 8), SP, {"per_device_train_batch_size": 1})
    assert "--pad_to_multiple_of 2" in " ".join(sp.argv) and sp.gradient_accumulation_steps == 8


@pytest.mark.parametrize(
    "accel, trl, message",
    [
        ({**CP, "distributed_type": "DEEPSPEED"}, {}, r"context parallelism \(cp_size=2\) needs FSDP2"),
        ({**CP, "fsdp_config": {"fsdp_version": 1}}, {}, r"needs FSDP2: set distributed_type: FSDP and fsdp_config"),
        ({**SP, "deepspeed_config": {"zero_stage": 2}}, {}, r"\(sp_size=2\) needs DeepSpeed ZeRO-3"),
        ({**SP, "distributed_type": "FSDP"}, {}, r"needs DeepSpeed ZeRO-3"),
        (
            {**CP, "parallelism_config": {"parallelism_config_cp_size": 2, "parallelism_config_sp_size": 2}},
            {},
            r"sets both cp_size and sp_size",
        ),
        ({**CP, "parallelism_config": {"parallelism_config_cp_size": 3}}, {}, r"16 processes cannot be split .* = 3"),
        ({**CP, "parallelism_config": {"parallelism_config_cp_size": "x"}}, {}, r"cp_size='x' .* not a whole number"),
        ({**CP, "parallelism_config": {"parallelism_config_cp_size": 0}}, {}, r"cp_size=0 .* must be at least 1"),
        (CP, {"pad_to_multiple_of": 6}, r"pad_to_multiple_of=6 must be a multiple of 2 x cp_size = 4"),
        (SP, {"pad_to_multiple_of": 3}, r"pad_to_multiple_of=3 must be a multiple of sp_size = 2"),
    ],
)
def test_impossible_parallel_combinations_name_the_fix(accel, trl, message):
    with pytest.raises(OrchError, match=message):
        node.plan(env(2, 8), accel, {"per_device_train_batch_size": 1, **trl})


def test_a_fitting_pad_is_kept():
    plan = node.plan(env(1, 8), CP, {"per_device_train_batch_size": 1, "pad_to_multiple_of": 8})
    assert "--pad_to_multiple_of" not in plan.argv


def test_cpu_runs_without_parallelism_and_says_so():
    plan = node.plan(env(2, 1, ORCH_DEVICE="cpu"), CP, {"per_device_train_batch_size": 1})
    assert not any(a.startswith("--parallelism_config") for a in plan.argv)
    assert plan.data_parallel_size == 2 and "no context/sequence parallelism" in plan.notes[0]


@pytest.mark.parametrize(
    "extra, trl, message",
    [
        (
            {"GLOBAL_BATCH_SIZE": "32", "TRL_TRAINER": "grpo"},
            {"num_generations": 3, "per_device_train_batch_size": 1},
            # multiples of 3 that 2 ranks x 1 also divide (33, offered before, then failed the accumulation's check)
            r"^GRPO: GLOBAL_BATCH_SIZE=32 completions is not a multiple of num_generations=3; use .*=30 or 36$",
        ),
        (
            {"GLOBAL_BATCH_SIZE": "32", "TRL_TRAINER": "grpo"},
            {"num_generations": 6, "per_device_train_batch_size": 1},
            r"num_generations=6; use GLOBAL_BATCH_SIZE=30 or 36$",
        ),
        ({"TRL_TRAINER": "kto"}, {"per_device_train_batch_size": 1}, r"KTO needs per_device_train_batch_size >= 2"),
        ({"GLOBAL_BATCH_SIZE": "0"}, {}, r"GLOBAL_BATCH_SIZE=0 must be at least 1"),
        ({"GLOBAL_BATCH_SIZE": "lots"}, {}, r"GLOBAL_BATCH_SIZE='lots' is not a whole number"),
        ({}, {"per_device_train_batch_size": 0}, r"per_device_train_batch_size=0 must be at least 1"),
    ],
)
def test_batch_errors(extra, trl, message):
    with pytest.raises(OrchError, match=message):
        node.plan(env(1, 2, **extra), {"distributed_type": "MULTI_GPU"}, trl)


@settings(max_examples=400, deadline=None)
@given(trainer=st.sampled_from(["sft", "dpo", "kto", "grpo", "rloo"]), global_batch=st.integers(1, 200),
       per_device=st.integers(1, 12), nodes=st.integers(1, 3), per_node=st.integers(1, 8),
       group=st.integers(1, 12))  # fmt: skip
def test_every_batch_fix_a_refusal_offers_is_one_the_node_takes(trainer, global_batch, per_device, nodes, per_node,
                                                                 group):  # fmt: skip
    """The batch refusals offered choices another batch rule refused: a per-device batch of 1 to KTO, a
    GLOBAL_BATCH_SIZE that is a multiple of num_generations but not of the per-device batch x ranks (or the other way
    round). Each per_device_train_batch_size=N or GLOBAL_BATCH_SIZE=N a refusal offers, applied alone, must plan."""
    extra = {"GLOBAL_BATCH_SIZE": str(global_batch), "TRL_TRAINER": trainer}
    trl = {"per_device_train_batch_size": per_device, "num_generations": group}

    def plans(extra, trl) -> str | None:
        try:
            node.plan(env(nodes, per_node, **extra), {"distributed_type": "MULTI_GPU"}, trl)
        except OrchError as exc:
            return str(exc)
        return None

    refused = plans(extra, trl)
    if refused is None:
        return
    fixes = refused.split("; use ", 1)[-1]
    offered = [("per_device_train_batch_size", n) for n in re.findall(r"per_device_train_batch_size=(\d+)", fixes)]
    for pair in re.findall(r"GLOBAL_BATCH_SIZE=(\d+)(?: or (\d+))?", fixes):
        offered += [("GLOBAL_BATCH_SIZE", g) for g in pair if g]
    for key, value in offered:
        fixed = (({**extra, key: value}, trl) if key == "GLOBAL_BATCH_SIZE" else
                 (extra, {**trl, key: int(value)}))  # fmt: skip
        assert plans(*fixed) is None, (refused, key, value, plans(*fixed))


@settings(max_examples=300, deadline=None)
@given(trainer=st.sampled_from(["sft", "kto", "grpo", "rloo"]), global_batch=st.one_of(st.none(), st.integers(1, 256)),
       per_device=st.integers(1, 12), accumulation=st.integers(1, 6), nodes=st.integers(1, 3),
       per_node=st.integers(1, 8), group=st.integers(2, 8), spg=st.one_of(st.none(), st.integers(1, 4)),
       cp=st.booleans())  # fmt: skip
# 2 nodes x 1 process under cp 2 at a global batch the plan refuses: its "these shapes keep it" divided by the 0
# data-parallel ranks of 1 node's process (a ZeroDivisionError, not the refusal)
@example(trainer="sft", global_batch=1, per_device=2, accumulation=1, nodes=2, per_node=1, group=2, spg=None, cp=True)
def test_every_smaller_batch_a_memory_refusal_offers_plans_and_keeps_the_math(trainer, global_batch, per_device,
                                                                                accumulation, nodes, per_node, group,
                                                                                spg, cp):  # fmt: skip
    """A memory refusal names a smaller per-device batch (core/batch.smaller, core/batch.first_fitting): each one
    offered, applied with the settings that come with it, plans on the node (its batch rules: KTO's least, whole
    num_generations groups, the accumulation GLOBAL_BATCH_SIZE derives) and keeps the samples of an optimizer step and
    a GRPO/RLOO generation batch; and under GLOBAL_BATCH_SIZE every smaller batch the node would take is offered."""
    from orchestrator.core import generation_memory, trainers
    from orchestrator.core.accelerate_config import AccelerateConfig

    spec = trainers.spec(trainer)
    cp = cp and trainer == "sft" and nodes * per_node % 2 == 0
    accel = CP if cp else {"distributed_type": "MULTI_GPU"}
    extra = {"TRL_TRAINER": trainer, "GLOBAL_BATCH_SIZE": str(global_batch or "")}
    trl: dict = {"per_device_train_batch_size": per_device}
    trl |= {} if global_batch else {"gradient_accumulation_steps": accumulation}
    trl |= {"num_generations": group, **({"steps_per_generation": spg} if spg else {})} if spec.generates else {}

    def planned(trl):
        try:
            return node.plan(env(nodes, per_node, **extra), accel, trl)
        except OrchError:
            return None

    def samples(plan, trl) -> int:  # an optimizer step's, over the data-parallel ranks
        steps = plan.gradient_accumulation_steps or trl.get("gradient_accumulation_steps", 1)
        return plan.per_device_batch * plan.data_parallel_size * steps

    world = nodes * per_node
    before = planned(trl)
    if before is None:  # the batch checks' own refusal comes first
        return
    offered = batch.smaller(trl, global_batch, world, AccelerateConfig.of(accel).parallelism, spec)
    assert [s.batch for s in offered] == sorted({s.batch for s in offered}, reverse=True)
    for smaller in offered:
        fixed = {**trl, **{key: int(value) for key, value in smaller.overrides}}
        after = planned(fixed)
        assert after is not None and after.per_device_batch == smaller.batch < per_device, (smaller, fixed)
        assert samples(after, fixed) == samples(before, trl), smaller
        if spec.generates:
            rows = generation_memory.rows_of(fixed, world, global_batch)
            assert rows == generation_memory.rows_of(trl, world, global_batch), smaller
    if global_batch and not spg:
        taken = {b for b in range(1, per_device) if planned({**trl, "per_device_train_batch_size": b})}
        assert {s.batch for s in offered} == taken
    # the runtime out-of-memory fix (memory_fix.propose, with the node plan's own world and parallelism) picks from the
    # same list: the largest at most half the batch, else the smallest; none only where the list is empty
    fix = memory_fix.propose(trl, extra, world, before.sizes)
    assert (fix.smaller is None) == (not offered), fix
    if offered:
        assert fix.smaller in offered and (2 * fix.smaller.batch <= per_device or fix.smaller == offered[-1]), fix
        assert all(2 * s.batch > per_device for s in offered[: offered.index(fix.smaller)]), fix


# ---------------------------------------------------------------- vLLM server node (GRPO)

GRPO = {"TRL_TRAINER": "grpo", "VLLM_SERVER_NODES": "1", "GLOBAL_BATCH_SIZE": "256"}
GRPO_TRL = {"model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "per_device_train_batch_size": 8, "use_vllm": True,
            "vllm_mode": "server"}  # fmt: skip


def test_vllm_server_node_and_trainers():
    server = node.plan(env(3, 8, rank=2, **GRPO), {"distributed_type": "MULTI_GPU"}, GRPO_TRL)
    assert server.role == "vllm-server"
    assert server.argv == [
        "trl", "vllm-serve", "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--tensor_parallel_size", "1",
        "--data_parallel_size", "8", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip
    trainer = node.plan(env(3, 8, rank=1, **GRPO), {"distributed_type": "MULTI_GPU"}, GRPO_TRL)
    argv = " ".join(trainer.argv)
    assert "--num_processes 16 --num_machines 2 --machine_rank 1 --main_process_ip 10.1.0.1" in argv
    assert "--vllm_server_host 10.1.0.3 --vllm_server_port 8000" in argv
    assert trainer.gradient_accumulation_steps == 2  # 256 completions = 8 x 16 trainer ranks x 2


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"VLLM_SERVER_NODES": "2"}, r"on 0 or 1 node"),
        ({"TRL_TRAINER": "dpo"}, r"VLLM_SERVER_NODES=1 serves generations for (\w+, )*grpo\b.*; TRL_TRAINER is dpo"),
        ({"VLLM_TENSOR_PARALLEL_SIZE": "3"}, r"must divide the 8 GPUs"),
    ],
)
def test_vllm_server_errors(extra, message):
    with pytest.raises(OrchError, match=message):
        node.plan(env(2, 8, rank=1, **{**GRPO, **extra}), {"distributed_type": "MULTI_GPU"}, GRPO_TRL)


def test_vllm_server_needs_a_second_node():
    with pytest.raises(OrchError, match=r"needs at least 2 nodes"):
        node.plan(env(1, 8, **GRPO), {"distributed_type": "MULTI_GPU"}, GRPO_TRL)


def test_server_node_stops_its_server_when_the_trainers_finish():
    """The server node watches the head's rendezvous port: open (training), then closed (done)."""
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen()
    port = head.getsockname()[1]
    threading.Timer(1.5, head.close).start()  # the trainers finish after ~1.5 s
    started = time.monotonic()
    code = node_exec.serve_until_training_ends(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        "127.0.0.1",
        port,
        env={"ORCH_VLLM_POLL_SECONDS": "0.2", "ORCH_VLLM_CLOSED_POLLS": "3"},
    )
    assert code == 0 and time.monotonic() - started < 30


def test_server_node_fails_when_its_server_dies():
    code = node_exec.serve_until_training_ends(
        [sys.executable, "-c", "raise SystemExit(3)"], "127.0.0.1", 9, env={"ORCH_VLLM_POLL_SECONDS": "0.1"}
    )
    assert code == 3


# ---------------------------------------------------------------- preflight


def test_memory_check_suggests_a_strategy_that_fits():
    from orchestrator.core import memory, models

    llama8 = memory.Setup(models.KNOWN_ARCHS["meta-llama/llama-3.1-8b-instruct"], strategy="ddp", micro_batch=2,
                          seq_len=4096)  # fmt: skip
    with pytest.raises(
        OrchError,
        match=r"^8.03B sft \(full, 2 x 4096 tokens per device\) needs ~\d+\.\d GiB per GPU \(weights 15.0, .*\) under "
        r"DDP on 8 GPU\(s\), more than one A100-80GB holds \(80 GiB\); FSDP2 on 8 GPUs needs ~\d+\.\d GiB per GPU, "
        r"or use GH200 \(96 GiB\); `orch plan` lists what fits$",
    ):
        preflight.check_memory(llama8, "A100-80GB")
    llama70 = memory.with_(llama8, arch=models.KNOWN_ARCHS["meta-llama/llama-3.1-70b-instruct"], strategy="fsdp")
    with pytest.raises(OrchError, match=r"ZeRO-3 with CPU offload on 8 GPUs needs ~"):
        preflight.check_memory(memory.with_(llama70, micro_batch=1, seq_len=1024), "A100-80GB")
    assert preflight.check_memory(memory.with_(llama8, strategy="fsdp"), "A100").gib < 40


def test_fsdp_wrap_class_must_match_the_architecture():
    accel = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}
    preflight.check_fsdp_wrap(accel, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(OrchError, match=r"is LlamaDecoderLayer but Qwen/Qwen3-8B is built of Qwen3DecoderLayer"):
        preflight.check_fsdp_wrap(accel, "Qwen/Qwen3-8B")


def test_context_parallel_needs_sdpa_and_one_checkpointing():
    preflight.check_context_parallel(CP, {"attn_implementation": "sdpa", "gradient_checkpointing": False}, {})
    with pytest.raises(OrchError, match=r"needs SDPA attention, not flash_attention_2"):
        preflight.check_context_parallel(CP, {"attn_implementation": "flash_attention_2"}, {})
    both = {**CP, "fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}
    with pytest.raises(OrchError, match=r"cannot both be on"):
        preflight.check_context_parallel(both, {"attn_implementation": "sdpa"}, {"gradient_checkpointing": "true"})


def test_sequence_parallel_needs_zero3():
    preflight.check_sequence_parallel(SP)
    with pytest.raises(OrchError, match=r"needs DeepSpeed ZeRO-3"):
        preflight.check_sequence_parallel({**SP, "deepspeed_config": {"zero_stage": 1}})


def test_accelerator_and_split_checks():
    assert preflight.check_accelerator("H100:8") == ("H100", 8, 80)
    with pytest.raises(OrchError, match=r"name a GPU type"):
        preflight.check_accelerator("CPU:4")
    preflight.check_process_split(16, 2)
    with pytest.raises(OrchError, match=r"10 processes cannot be split evenly over 4 nodes"):
        preflight.check_process_split(10, 4)


def test_launch_refuses_a_recipe_that_cannot_fit():
    result = orch(
        "run", "llama3_sft_zero3", "--env", "ACCELERATE_CONFIG=multi_gpu", "--secret", "HF_TOKEN=x", "--dry-run"
    )
    assert result.returncode == 2 and "needs ~90.7 GiB per GPU (weights 15.0, gradients 29.9, optimizer 29.9, " \
        "activations 3.3, lm head 3.4, overhead 9.2) under DDP on 8 GPU(s)" in result.stderr  # fmt: skip
    assert "FSDP2 on 8 GPUs needs ~27.7 GiB per GPU" in result.stderr and result.stdout == ""


def test_dry_run_shows_batch_and_memory():
    result = orch("run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run", "--skip-optimizer")
    assert result.returncode == 0, result.stderr
    assert "batch: GLOBAL_BATCH_SIZE 64 = 4 per device x 16 data-parallel ranks x 1 accumulation steps" in result.stdout
    assert re.search(r"memory: ~\d+\.\d GiB per GPU \(weights .*, activations .*\) under FSDP2 on 16 GPUs, 4 x 2048 "
                     r"tokens per device; each A100 has 40 GiB", result.stdout), result.stdout  # fmt: skip


# ---------------------------------------------------------------- the same math at every shape (end to end)


@pytest.mark.e2e
@pytest.mark.xdist_group("phi3_fsdp2_run")
def test_loss_is_the_same_at_every_cluster_shape(project, phi3_fsdp2_run):
    """FSDP2 for real on 2x1 trains the losses DDP trains on 2x1, every step; the same run, resumed at step 4 on 1x2
    and on 1x1 (doubled accumulation; DCP reshards the checkpoint on load), trains steps 5-8 at those losses and says
    so (issue 32: a run resumes at any shape that keeps its global batch; reshaped.py). The 2x1 FSDP2 run (the demo's
    command, conftest.phi3_fsdp2_run) is also checked end to end (test_local_run.check_demo_run)."""
    from conftest import loss_log, output_dir_of
    from reshaped import resumed_at, said

    ddp_run = orch("run", "phi3_dpo_fsdp", "--local", "--smoke", "--nodes", "2", "--env", "ACCELERATE_CONFIG=multi_gpu",
                   cwd=project)  # fmt: skip
    assert ddp_run.returncode == 0, ddp_run.stdout[-3000:]
    out_dir = output_dir_of(ddp_run, project)
    demo, tmp_path = phi3_fsdp2_run, phi3_fsdp2_run.project  # the resumes below run in the demo run's project
    check_demo_run(demo.result, tmp_path)  # one process group over both nodes, what it wrote and said
    runs = {
        "ddp 2x1": (loss_log(out_dir), json.loads((out_dir / "orch" / "rank0.json").read_text()), out_dir),
        "fsdp2 2x1": (demo.losses, demo.report, demo.output_dir),
    }
    ddp = runs["ddp 2x1"][1]  # DDP, no sharding: the only strategy fact is DDP's own flag (smoke runs set it off)
    assert ddp["distributed_type"] == "MULTI_CPU" and ddp["strategy"] == {"ddp_find_unused_parameters": False}
    reference = runs["ddp 2x1"][0]
    assert sorted(reference) == list(range(1, 9))
    expected, fsdp, out_dir = runs["fsdp2 2x1"]
    for label, (losses, report, _) in runs.items():
        assert report["optimizer_steps"] == 8 and report["total_samples"] == 16 * 8, label
        assert report["resumed_from"] is None
        assert losses == pytest.approx(reference, abs=1e-4), label
    for shape, world, now in (
        (["--nodes", "1", "--gpus", "CPU:2"], 2, "1 x 2 (world size 2 -> 2: the same partitions)"),
        (["--nodes", "1"], 1, "1 x 1 (resharded: torch.distributed.checkpoint on load)"),
    ):
        rerun = resumed_at(tmp_path, "phi3_dpo_fsdp", out_dir, expected, *shape)
        said(rerun, f"[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now {now}")
        report = json.loads((out_dir / "orch" / "rank0.json").read_text())
        facts = report["strategy"]
        assert report["distributed_type"] == "FSDP" and facts["fsdp_version"] == 2, shape
        assert facts["sharded_params"] == facts["params"] > 0 and facts["ref_sharded_params"] == facts["ref_params"]
        assert report["world_size"] == world and report["resumed_from"].endswith("checkpoint-4"), shape
        accumulation = fsdp["gradient_accumulation_steps"] * 2 // world  # the global batch kept on fewer ranks
        assert report["gradient_accumulation_steps"] == accumulation, shape
        assert loss_log(out_dir) == pytest.approx({k: v for k, v in reference.items() if k > 4}, abs=1e-4)


@pytest.mark.unit
def test_the_shapes_that_keep_a_global_batch_are_named():
    """A resume at another shape keeps GLOBAL_BATCH_SIZE only where the data-parallel ranks divide it: the batch
    error names the node counts that do (node/plan.py), here with tensor/context parallel groups of 2 as well."""
    from orchestrator.core import batch as batch_math

    assert batch_math.nodes_that_keep(64, 4, 8, lambda total: total) == [1, 2]
    assert batch_math.nodes_that_keep(64, 4, 8, lambda total: total // 2) == [1, 2, 4]
    assert batch_math.nodes_that_keep(60, 4, 8, lambda total: total) == []
    assert batch_math.say_nodes([1, 2, 4]) == "1, 2 or 4"
    assert batch_math.say_nodes(list(range(1, 10))) == "1, 2, 3, 4, 5, 6, ..."
