"""The node launcher: SkyPilot env -> accelerate argv (pure, snapshot-tested) and its CLI."""

import sys

import pytest
from conftest import check_snapshot, orch

from orchestrator.core.configs import CPU_CONFIG, resolve_accelerate_config
from orchestrator.core.errors import OrchError
from orchestrator.node import plan as node

pytestmark = pytest.mark.unit

FSDP = {"distributed_type": "FSDP"}
DPO = {"per_device_train_batch_size": 4}


def test_rank1_of_2x8_exact_argv(node_env):
    argv = node.plan(node_env(2, 8, 1), FSDP, DPO).argv
    assert argv == [
        "accelerate",
        "launch",
        "--config_file",
        "recipes/accelerate/fsdp2_phi3.yaml",
        "--num_processes",
        "16",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29500",
        "--rdzv_backend",
        "static",
        "--same_network",
        "--module",
        "orchestrator.train",
        "dpo",
        "--config",
        "recipes/trl/phi3_dpo.yaml",
        "--gradient_accumulation_steps",
        "1",
    ]


@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 8), (2, 8), (4, 8)])
def test_argv_snapshots(node_env, nodes, gpus):
    lines = []
    trl = {"per_device_train_batch_size": 2}  # 64 samples over up to 32 ranks
    for rank in range(nodes):
        plan = node.plan(node_env(nodes, gpus, rank), FSDP, trl)
        lines.append(" ".join(plan.argv))
        assert plan.argv == node.plan(node_env(nodes, gpus, rank), FSDP, trl).argv  # same env, same argv
    check_snapshot(f"node_{nodes}x{gpus}.txt", "\n".join(lines) + "\n")


@pytest.mark.parametrize("nodes, gpus, ga", [(1, 1, 16), (1, 8, 2), (2, 8, 1)])
def test_accumulation_keeps_global_batch(node_env, nodes, gpus, ga):
    plan = node.plan(node_env(nodes, gpus, 0), FSDP, DPO)
    assert plan.gradient_accumulation_steps == ga


def test_deepspeed_gets_standard_multinode_launcher(node_env):
    argv = node.plan(node_env(2, 8, 0), {"distributed_type": "DEEPSPEED"}, DPO).argv
    i = argv.index("--deepspeed_multinode_launcher")
    assert argv[i + 1] == "standard"


def test_cpu_runs_ddp_over_torchrun_path(node_env):
    plan = node.plan(node_env(2, 1, 0, ORCH_DEVICE="cpu"), FSDP, DPO)
    assert "--multi_gpu" in plan.argv and "--cpu" not in plan.argv
    assert plan.argv[plan.argv.index("--config_file") + 1] == str(CPU_CONFIG)
    assert plan.argv[-2:] == ["--use_cpu", "true"]
    assert plan.runs_as == "DDP over gloo"
    assert any("asks for fsdp1" in n and "DDP over gloo" in n for n in plan.notes)


def test_overrides_reach_the_trl_script_after_config(node_env):
    env = node_env(1, 8, 0, TRL_OVERRIDES="learning_rate=1e-5 'run_name=a b'")
    argv = node.plan(env, FSDP, DPO).argv
    tail = argv[argv.index("--config") :]
    assert tail[:6] == ["--config", "recipes/trl/phi3_dpo.yaml", "--learning_rate", "1e-5", "--run_name", "a b"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"TRL_TRAINER": "ppo"}, r"TRL_TRAINER='ppo' is not a trainer orch runs"),
        ({"TRL_TRAINER": ""}, r"TRL_TRAINER is not set"),
        ({"MAIN_PROCESS_PORT": "70000"}, r"MAIN_PROCESS_PORT='70000' is not a TCP port"),
        (
            {"GLOBAL_BATCH_SIZE": "60"},
            r"GLOBAL_BATCH_SIZE=60 is not a multiple of .* = 4 x 16 = 64; use "
            r"GLOBAL_BATCH_SIZE=64, or 15 data-parallel ranks$",
        ),
        (
            {"GLOBAL_BATCH_SIZE": "32"},
            r"= 4 x 16 = 64; use per_device_train_batch_size=2, or GLOBAL_BATCH_SIZE=64, "
            r"or 8 data-parallel ranks; at this per-device batch these shapes keep it: 1 node\(s\) x 8 \(--nodes\)$",
        ),
        ({"TRL_OVERRIDES": "gradient_accumulation_steps=4"}, r"derived from GLOBAL_BATCH_SIZE"),
        ({"ORCH_DEVICE": "tpu"}, r"ORCH_DEVICE='tpu': ORCH_DEVICE takes gpu or cpu"),
        # `sky launch --env TRL_OVERRIDES=...` without CHECKPOINT_ROOT: the final model would go among the workdir's
        # own files, or the home's
        ({"TRL_OVERRIDES": "output_dir=."}, r"^output_dir=\.: the directory the run starts in"),
        ({"TRL_OVERRIDES": "output_dir=~/"}, r"^output_dir=~/: a home directory"),
        ({"TRL_OVERRIDES": "output_dir=/"}, r"^output_dir=/: the file system root"),
        ({"TRL_OVERRIDES": "output_dir="}, r"^output_dir= is empty"),
    ],
)
def test_bad_node_env(node_env, extra, message):
    with pytest.raises(OrchError, match=message):
        node.plan(node_env(2, 8, 0, **extra), FSDP, DPO)


def test_an_output_dir_is_checked_where_the_ranks_would_write_to_it(node_env):
    """The TRL config's own output_dir is checked too; with CHECKPOINT_ROOT, orch's CHECKPOINT_ROOT/<run> replaces
    whatever was given, so nothing is refused."""
    with pytest.raises(OrchError, match=r"^output_dir=\.\./\.\.: above the directory the run starts in"):
        node.plan(node_env(2, 8, 0), FSDP, {**DPO, "output_dir": "../.."})
    env = node_env(2, 8, 0, CHECKPOINT_ROOT="/checkpoints", ORCH_RUN_ID="r-1", TRL_OVERRIDES="output_dir=.")
    argv = node.plan(env, FSDP, {**DPO, "output_dir": "/"}).argv
    assert argv[argv.index("--output_dir") + 1] == "/checkpoints/r-1"
    for fine in ("outputs/x", "~/runs/x", "../runs/x", "/data/runs/x"):
        node.plan(node_env(2, 8, 0, TRL_OVERRIDES=f"output_dir={fine}"), FSDP, DPO)


def test_cli_print_reads_real_config_files(node_env):
    result = orch("node", "--print", env=node_env(2, 8, 1))
    assert result.returncode == 0, result.stderr
    where, command = result.stdout.split("\n", 1)
    assert where == "# SkyPilot: node 1 of 2, 8 process(es) per node, head 10.0.0.1"
    assert command.startswith("accelerate launch --config_file recipes/accelerate/fsdp2_phi3.yaml")
    assert "--num_processes 16 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1" in result.stdout
    # 64 global / (4 per device x 16 ranks)
    assert result.stdout.rstrip().endswith("--gradient_accumulation_steps 1")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"SKYPILOT_NODE_RANK": "5"}, "SKYPILOT_NODE_RANK=5 is outside 0..1"),
        ({"SKYPILOT_NODE_IPS": "10.0.0.1"}, "lists 1 address(es)"),
        ({"SKYPILOT_NUM_GPUS_PER_NODE": "0"}, "the task has no GPUs"),
        ({"SKYPILOT_NUM_NODES": ""}, "SKYPILOT_NUM_NODES is not set"),
        ({"TRL_CONFIG": "recipes/trl/nope.yaml"}, "TRL config recipes/trl/nope.yaml cannot be read"),
    ],
)
def test_cli_bad_env_exits_2_with_one_line(node_env, changes, message):
    result = orch("node", "--print", env=node_env(2, 8, 0, **changes))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_profile_name_resolves_to_trl_file():
    path = resolve_accelerate_config("zero3")
    assert path.name == "zero3.yaml" and path.is_file()
    assert resolve_accelerate_config("recipes/x.yaml").as_posix() == "recipes/x.yaml"


def test_the_node_runs_accelerates_launch_module_with_the_planned_arguments(node_env):
    """`accelerate launch ARGS` runs as `python -m accelerate.commands.launch ARGS`: accelerate's own launch parser
    and launch_command without the console script's import of every other subcommand; what the parser makes of the
    arguments is the same either way. The smoke run that pushes to the Hub reads the processes back."""
    import sys

    from accelerate.commands.launch import launch_command_parser

    from orchestrator.node.exec import runnable

    argv = node.plan_from_env(node_env(2, 8, 1)).argv
    run = runnable(argv)
    assert run == [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]
    parsed = launch_command_parser().parse_args(run[3:])  # the parser `python -m accelerate.commands.launch` builds
    assert (parsed.num_processes, parsed.num_machines, parsed.machine_rank) == (16, 2, 1)
    assert runnable(["vllm", "serve", "m"]) == ["vllm", "serve", "m"]


def test_the_relay_hides_known_notices_and_keeps_everything_else():
    """Third-party notices nobody can act on are held back (node/output.NOTICES), with the rest of their block; what
    follows, errors included, is relayed; DeepSpeed's no-GPU warning is hidden on CPU runs only."""
    import io

    from orchestrator.node.supervise import _Relay

    ds = ("[2026-11-23 20:18:29,480] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
          "If you have GPU or other accelerator, we were unable to detect it.\n")  # fmt: skip
    race = [
        "[W1123 20:19:49.104546805 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=4, "
        "addr=[::1]:1, remote=[::1]:2): Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
        "server shutdown or crash?\n",
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)\n",
        "<omitting python frames>\n",
        "\n",
        "E1123 20:19:49.158000 12952 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit "
        "barrier. Elapsed: 0.02 seconds\n",
        "E1123 20:19:49.158000 12952 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call\n",
    ]
    kernel = [  # bitsandbytes' CPU kernel from the Kernels Hub: without the kernels package, and offline with it
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure you "
        "already `pip install kernels` and the kernels >= 0.11.1\n",
        "/v/lib/python3.11/site-packages/bitsandbytes/backends/cpu/ops.py:247: UserWarning: Skipping publisher trust "
        "check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub is in offline mode.\n",
        "  gemm_4bit_forward_kernel = get_kernel(\n",
        "Failed to load CPU gemm_4bit_forward from kernels-community: Version 1 of 'kernels-community/quantization-"
        "bitsandbytes' is not available in the local cache and Hugging Face Hub is in offline mode. Download the "
        "kernel while online first, or pass an explicit `revision=<commit>`.. Please make sure you already `pip "
        "install kernels` and the kernels >= 0.11.1\n",
    ]
    after = ["[orch] done\n", "frame #9: a C++ frame of something else\n", "ValueError: x\n"]  # not a notice's block
    lines = [ds, *kernel, "[orch] step 1/8 loss=0.69\n", *race, *after]
    for cpu, hidden in ((True, 1 + len(kernel) + len(race)), (False, len(kernel) + len(race))):
        out = io.StringIO()
        sys_stdout, sys.stdout = sys.stdout, out
        try:
            relay = _Relay(io.StringIO("".join(lines)), cpu=cpu)
            relay.thread.join(5)
        finally:
            sys.stdout = sys_stdout
        assert len(relay.hidden) == hidden, relay.hidden
        shown = out.getvalue().splitlines()
        assert shown == [*([] if cpu else [ds.strip()]), "[orch] step 1/8 loss=0.69", *(x.strip() for x in after)]
        assert relay.errors == ["ValueError: x"]


def _traceback(raiser) -> list[str]:
    """The lines Python prints for what `raiser` raises (a chain included)."""
    import traceback

    try:
        raiser()
    except Exception as exc:
        return "".join(traceback.format_exception(exc)).splitlines()
    raise AssertionError("nothing raised")


def test_an_error_raised_from_another_is_quoted_not_its_bare_cause():
    """transformers' `raise KeyError("The metric_for_best_model ... available metrics are ...") from exc` printed
    `KeyError: 'eval_bogus'` first: the explanation is the later error of the chain, each rank's read apart; an error
    raised while another was handled is not: there the first is the cause; nor a launcher's summary raised from it."""
    from orchestrator.node.output import ErrorLines, first_error

    def explained():
        try:
            {}["eval_bogus"]
        except KeyError as exc:
            raise KeyError("The `metric_for_best_model` ... available metrics are: ['eval_loss']") from exc

    def handled():
        try:
            {}["eval_bogus"]
        except KeyError:
            raise RuntimeError("cleanup failed")  # noqa: B904 (the implicit context is what is tested)

    def summary():
        try:
            raise ValueError("the real one")
        except ValueError as exc:
            raise RuntimeError("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: x") from exc

    said = "KeyError: \"The `metric_for_best_model` ... available metrics are: ['eval_loss']\""
    rank0, rank1 = ([f"[rank{r}]: {line}" for line in _traceback(explained)] for r in (0, 1))
    errors = ErrorLines()
    for line in [x for pair in zip(rank0, rank1, strict=True) for x in pair]:  # the ranks' lines interleaved
        errors.feed(line)
    assert errors == [said, said]
    for raiser, first in ((handled, "KeyError: 'eval_bogus'"), (summary, "ValueError: the real one")):
        errors = ErrorLines()
        for line in _traceback(raiser):
            errors.feed(line)
        assert first_error(errors) == first, errors


def test_a_failing_node_shows_the_notices_it_held_back(tmp_path):
    from conftest import supervised

    script = (
        "print(\"Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make "
        "sure you already `pip install kernels` and the kernels >= 0.11.1\", flush=True); raise ValueError('bad')"
    )
    done = supervised(script, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Failed to load CPU gemm_4bit_forward" in done.stdout  # a failing node hides nothing
    assert "[orch] failed on node 0: accelerate exited with code 1: ValueError: bad" in done.stdout + done.stderr


LEAVES_TEMPORARY_FILES = """
import json, os, tempfile
os.mkdir(os.path.join(tempfile.gettempdir(), "torchelastic_x"))  # what torch's elastic agent makes at every launch
print("SEEN", json.dumps([tempfile.gettempdir(), os.environ.get("TORCHINDUCTOR_CACHE_DIR")]), flush=True)
"""


def test_a_launch_s_temporary_files_go_with_it_and_torch_compile_s_cache_stays_shared(tmp_path):
    """On a cluster's node `orch node` gives its accelerate launch a temporary directory of its own, removed when the
    launch ends (torch's elastic agent made a torchelastic_* directory per launch in the node's /tmp and never removed
    it), while torch.compile's cache stays where torch keeps it without that TMPDIR, shared by every launch."""
    import getpass
    import json
    import os
    import tempfile
    from pathlib import Path

    from conftest import supervised

    done = supervised(LEAVES_TEMPORARY_FILES, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    launch_tmp, inductor = json.loads(done.stdout.split("SEEN ", 1)[1].splitlines()[0])
    # the node's own temporary directory: the runner's, from this process's environment (this process's tempfile
    # module may have chosen before the suite set TMPDIR)
    here = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    assert Path(launch_tmp).parent == here and Path(launch_tmp).name.startswith("orch-launch-")
    assert not Path(launch_tmp).exists()  # gone with the launch, the elastic agent's directory with it
    assert inductor == str(here / f"torchinductor_{getpass.getuser()}")
    # a local run's node: its TMPDIR, ORCH_HOME/tmp, is the run's already (launch/backends/local_nodes.py), and one more
    # level would lengthen the AF_UNIX socket paths made under it
    (tmp_path / "tmp").mkdir()
    done = supervised(LEAVES_TEMPORARY_FILES, tmp_path, env={"TMPDIR": str(tmp_path / "tmp")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.split("SEEN ", 1)[1].splitlines()[0]) == [str(tmp_path / "tmp"), None]
    assert (tmp_path / "tmp" / "torchelastic_x").is_dir()  # removed with the run's node directory, not by the launch


def test_under_a_long_tmpdir_the_launch_s_temporary_directory_lies_in_tmp(tmp_path):
    """A node whose TMPDIR is too long for Python's AF_UNIX sockets under the launch's own directory (a scheduler's
    per-job TMPDIR) gives the launch one in /tmp: DataLoader workers failed with 'AF_UNIX path too long' below it."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from conftest import supervised

    from orchestrator.core.home import SOCKET_TMPDIR

    def launch_tmp(tmpdir: Path) -> Path:
        tmpdir.mkdir()
        done = supervised(LEAVES_TEMPORARY_FILES, tmp_path, tmpdir=str(tmpdir))
        assert done.returncode == 0 and "warning" not in done.stdout, done.stdout + done.stderr
        made = Path(json.loads(done.stdout.split("SEEN ", 1)[1].splitlines()[0])[0])
        assert made.name.startswith("orch-launch-") and not made.exists()  # gone with the launch
        assert len(str(made).encode()) <= SOCKET_TMPDIR
        return made

    longest = SOCKET_TMPDIR - len("/orch-launch-12345678")  # the longest TMPDIR the launch's directory fits under
    base = Path(tempfile.mkdtemp(prefix="orch-t-", dir="/tmp"))  # tmp_path may be longer than that already
    try:
        fits = base / ("k" * (longest - len(str(base)) - 1))
        assert launch_tmp(fits).parent == fits and len(str(fits)) == longest
        over = base / ("j" * (longest - len(str(base))))
        assert launch_tmp(over).parent == Path("/tmp") and not any(over.iterdir())
    finally:
        shutil.rmtree(base)


def test_fsdp2_activation_checkpointing_recomputes_dropout_with_other_random_numbers():
    """The owners' code the rule below answers: accelerate's FSDP2 activation checkpointing wraps each layer with
    torch's checkpoint_wrapper(preserve_rng_state=False), whose recompute draws another dropout mask: the gradients
    differ from the uncheckpointed layer's, and match it with preserve_rng_state=True."""
    import copy
    import inspect

    import torch
    from accelerate.utils import fsdp_utils
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert "checkpoint_wrapper(layer, preserve_rng_state=False)" in inspect.getsource(fsdp_utils.fsdp2_apply_ac)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.5))
    x = torch.randn(8, 32)

    def grad(**wrapper) -> torch.Tensor:
        model = copy.deepcopy(layer)
        run = checkpoint_wrapper(model, **wrapper) if wrapper else model
        torch.manual_seed(1)
        run(x).pow(2).sum().backward()
        return model[0].weight.grad

    plain = grad()
    assert torch.equal(grad(preserve_rng_state=True), plain)
    assert not torch.allclose(grad(preserve_rng_state=False), plain)


def test_lora_dropout_under_fsdp2_activation_checkpointing_is_refused(node_env):
    from orchestrator.core import configs

    env = node_env(1, 8, 0, TRL_TRAINER="sft", TRL_CONFIG="recipes/trl/llama3_70b_qlora.yaml",
                   ACCELERATE_CONFIG="recipes/accelerate/fsdp2_llama.yaml", GLOBAL_BATCH_SIZE="16")  # fmt: skip
    accel, trl, _ = configs.load(env)
    node.plan(env, accel, trl)  # the recipe: lora_dropout 0
    with pytest.raises(OrchError, match=r"^lora_dropout is 0.05, but .*preserve_rng_state=False.*lora_dropout: 0.0"):
        node.plan({**env, "TRL_OVERRIDES": "lora_dropout=0.05"}, accel, trl)
    with pytest.raises(OrchError, match=r"^lora_dropout is TRL's default 0.05"):
        node.plan(env, accel, {k: v for k, v in trl.items() if k != "lora_dropout"})
    off = {**accel.raw, "fsdp_config": {**accel.raw["fsdp_config"], "fsdp_activation_checkpointing": False}}
    node.plan({**env, "TRL_OVERRIDES": "lora_dropout=0.05"}, off, trl)


def test_an_accelerate_config_that_hides_gpus_from_the_processes_is_refused(node_env):
    """A config's gpu_ids becomes CUDA_VISIBLE_DEVICES (accelerate.utils.launch), beside orch's one process per GPU:
    with '0,1' on an 8-GPU node, ranks 2-7 would find no GPU of their own. Every GPU, in any order, or all: taken."""
    from orchestrator.core import configs

    env = node_env(2, 8, 1, TRL_TRAINER="dpo", TRL_CONFIG="recipes/trl/phi3_dpo.yaml",
                   ACCELERATE_CONFIG="recipes/accelerate/fsdp2_phi3.yaml", GLOBAL_BATCH_SIZE="64")  # fmt: skip
    accel, trl, _ = configs.load(env)
    for ids in (None, "all", "0,1,2,3,4,5,6,7", "7,6,5,4,3,2,1,0"):
        node.plan(env, {**accel.raw, "gpu_ids": ids}, trl)
    for ids in ("0,1", "1,2,3,4,5,6,7,8", "0"):
        with pytest.raises(OrchError, match=rf"gpu_ids: '{ids}' is not every GPU of the node \(0-7\): accelerate"):
            node.plan(env, {**accel.raw, "gpu_ids": ids}, trl)
    from orchestrator.core import accelerate_schema

    with pytest.raises(OrchError, match=r"dynamo_config.dynamo_mode: 'fast' is not one accelerate takes; use one of "
                                        r"default, lite, reduce-overhead"):  # torch.compile's modes, not the parser's
        accelerate_schema.check_config({"dynamo_config": {"dynamo_mode": "fast"}}, "a.yaml")
    accelerate_schema.check_config({"dynamo_config": {"dynamo_backend": "INDUCTOR", "mode": "max-autotune"}}, "a.yaml")


def test_packed_rows_under_ulysses_need_flash_attention(node_env):
    """Ulysses drops the attention mask (DeepSpeed's ulysses_sp.py): packed or padding-free rows on SDPA attend across
    documents silently, so orch refuses them, and a model attention DeepSpeed would refuse on the GPUs."""
    from orchestrator.core import configs

    recipe = {"TRL_TRAINER": "sft", "TRL_CONFIG": "recipes/trl/qwen3_sft_long.yaml", "GLOBAL_BATCH_SIZE": "32",
              "ACCELERATE_CONFIG": "recipes/accelerate/alst_ulysses_sp2.yaml",
              "TRL_OVERRIDES": "attn_implementation=kernels-community/flash-attn2"}  # as qwen3_sft_alst  # fmt: skip
    env = node_env(1, 8, 0, **recipe)
    accel, trl, _ = configs.load(env)
    assert trl["packing"] is True
    plan = node.plan(env, accel, trl)  # the recipe: packed, flash attention from the Kernels Hub
    assert "--parallelism_config_sp_size" in plan.argv
    sdpa = {**accel.raw, "parallelism_config": {**accel.raw["parallelism_config"],
                                                "parallelism_config_sp_attn_implementation": "sdpa"}}  # fmt: skip
    for overrides, named in (("attn_implementation=sdpa", "packing"),
                             ("attn_implementation=sdpa packing=false padding_free=true", "padding_free")):
        with pytest.raises(OrchError, match=rf"^{named} put several documents in one row, but Ulysses sequence "
                                            r"parallelism \(sp_size=2\) drops the attention mask.*sp attention sdpa"):
            node.plan({**env, "TRL_OVERRIDES": overrides}, sdpa, trl)
    node.plan({**env, "TRL_OVERRIDES": "attn_implementation=sdpa packing=false"}, sdpa, trl)  # one document per row
    with pytest.raises(OrchError, match=r"^attn_implementation is sdpa but .* is kernels-community/flash-attn2"):
        node.plan({**env, "TRL_OVERRIDES": "packing=false"}, accel, trl)
    # on CPU the core attention is SDPA whatever the recipe names (node/launcher.py swaps it): packing is refused there
    cpu = node_env(2, 1, 0, **{**recipe, "GLOBAL_BATCH_SIZE": "2"}, ORCH_DEVICE="cpu")
    with pytest.raises(OrchError, match=r"^packing put several .* on CPU, where orch runs SDPA"):
        node.plan(cpu, accel, trl)
    argv = node.plan({**cpu, "TRL_OVERRIDES": "packing=false"}, accel, trl).argv
    assert argv[argv.index("--parallelism_config_sp_attn_implementation") + 1] == "sdpa"


@pytest.mark.parametrize(
    ("rank", "setup_seconds", "waits", "said"),
    [(0, 0.2, 600.0, ""), (0, 3.4, 603.0, ""), (0, 95.4, 695.0, " + 95 s, as long as this node's setup took"),
     (1, 95.4, 695.0, " + 95 s, as long as this node's setup took")],
)  # fmt: skip
def test_a_node_waits_at_the_barrier_beyond_as_long_as_its_own_setup_took(monkeypatch, capsys, rank, setup_seconds,
                                                                          waits, said):  # fmt: skip
    """`orch run` starts each node's run with its setup, so the nodes reach the barrier as their setups end: a slower
    download elsewhere is not a node that never comes."""
    from orchestrator.core.topology import Topology
    from orchestrator.node import barrier
    from orchestrator.node import exec as node_exec

    seen = {}

    def wait(*args):
        seen["timeout"] = args[-1]
        return 1.0

    monkeypatch.setattr(barrier, "head_wait", wait)
    monkeypatch.setattr(barrier, "worker_join", wait)
    cluster = Topology(nodes=2, gpus_per_node=1, node_rank=rank, node_ips=("10.0.0.1", "10.0.0.2"))
    node_exec._barrier({}, cluster, setup_seconds)
    assert seen["timeout"] == waits
    assert f"(timeout 600 s{said})" in capsys.readouterr().out


def test_a_node_that_never_joins_again_and_again_gives_up(monkeypatch, tmp_path):
    """The barrier's retryable failure (exit 75) counts as node/retries.py counts the others: the third in a row, with
    no step trained, exits 1 and says why (a firewall that never opens would restart a managed job without end)."""
    from orchestrator.core.errors import NotRetried, RetryableError
    from orchestrator.core.topology import Topology
    from orchestrator.node import barrier
    from orchestrator.node import exec as node_exec

    def unreachable(*args):
        raise RetryableError("node 1 could not reach the head at 10.0.0.1:29501 within 600 s")

    monkeypatch.setattr(barrier, "worker_join", unreachable)
    cluster = Topology(nodes=2, gpus_per_node=1, node_rank=1, node_ips=("10.0.0.1", "10.0.0.2"))
    argv = ["accelerate", "launch", "--output_dir", str(tmp_path / "run")]
    for _ in range(2):
        with pytest.raises(RetryableError) as retried:
            node_exec._barrier({}, cluster, 0.0, argv)
        assert retried.value.exit_code == 75
    with pytest.raises(NotRetried) as stopped:
        node_exec._barrier({}, cluster, 0.0, argv)
    assert stopped.value.exit_code == 1
    assert str(stopped.value).startswith("node 1 failed the retryable way 3 times in a row without training a step "
                                         "at all: not retried again")  # fmt: skip
    assert str(stopped.value).endswith(": node 1 could not reach the head at 10.0.0.1:29501 within 600 s")


def test_only_this_launchs_setup_lengthens_the_barrier():
    from orchestrator.node.exec import own_setup_seconds

    now = 1_000_000.0
    assert own_setup_seconds({"setup_started": now - 95.4, "setup_done": now - 0.1}, now) == pytest.approx(95.3)
    assert own_setup_seconds({"setup_started": now - 4000, "setup_done": now - 3600}, now) == 0.0  # an earlier launch's
    assert own_setup_seconds({"setup_started": now - 5}, now) == 0.0  # a setup that never ended
    assert own_setup_seconds({"setup_done": now - 1}, now) == 0.0  # no start recorded: no length, never negative
    assert own_setup_seconds({}, now) == 0.0  # the local backend: no setup


def test_a_local_runs_ports_are_distinct_and_free():
    """The emulated nodes' rendezvous and barrier ports are picked together: two ports picked one after the other were
    once the same one (the nodes refused it: "ORCH_BARRIER_PORT=57795 is MAIN_PROCESS_PORT's port too")."""
    import socket

    from orchestrator.launch.backends.local_nodes import free_ports

    for _ in range(20):
        ports = free_ports(40)
        assert len(set(ports)) == 40, ports
    with socket.socket() as sock:  # released: a node can listen on each
        sock.bind(("127.0.0.1", ports[0]))


def test_a_local_run_passes_over_the_ports_skypilots_nodes_hold(monkeypatch):
    """46590 (SkyPilot's skylet) lies in Linux's ephemeral range: a local run given it would be refused by its own
    nodes (knobs.NODE_PORTS), so free_ports holds it and picks another."""
    import socket

    from orchestrator.core import knobs
    from orchestrator.launch.backends import local_nodes

    answers = iter([46590, 22, 40001, 40002])

    class Picked(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(answers))

    monkeypatch.setattr(local_nodes.socket, "socket", Picked)
    assert local_nodes.free_ports(2) == [40001, 40002]
    assert 46590 in knobs.NODE_PORTS and 22 in knobs.NODE_PORTS
