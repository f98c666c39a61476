"""The head node's memory check in the setup (node/memory.py): core/fit.py's rules against what the node reports, so a
plain `sky launch` gets them. Host memory is read from the kernel: a real cgroup v1 memory limit (root) makes a recipe
that fits this machine's MemTotal refused. The GPU side reads nvidia-smi, which this machine lacks: a stand-in prints
its documented `--query-gpu=name,memory.total --format=csv,noheader,nounits` lines (`make gpu-check` reads the real
one on a GPU)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.memory import GIB
from orchestrator.node import memory

ROOT = Path(__file__).resolve().parent.parent
MEMORY_CGROUP = Path("/sys/fs/cgroup/memory")

# Qwen2.5-0.5B, DDP, 2 nodes x 8: every rank reads the 0.9 GiB checkpoint (the node's page cache holds it once)
SETUP_ENV = {
    "SKYPILOT_SETUP_NODE_RANK": "0",
    "SKYPILOT_SETUP_NODE_IPS": "10.0.0.1\n10.0.0.2\n",
    "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": "8",
    "TRL_TRAINER": "sft",
    "TRL_CONFIG": "recipes/trl/qwen25_sft.yaml",
    "ACCELERATE_CONFIG": "multi_gpu",
    "ORCH_REHEARSAL": "off",  # the memory check runs before it; the rehearsal itself is tests/test_rehearsal.py's
    "ORCH_DEVICE": "gpu",
}


def rehearse(env: dict, cgroup: Path | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    """`orch node --rehearse` as node-setup.sh runs it, optionally inside a memory cgroup from its first instruction."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SKYPILOT_", "ORCH_MEMORY"))}
    full.update(env)
    if path is not None:
        full["PATH"] = path
    enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    return subprocess.run([sys.executable, "-m", "orchestrator", "node", "--rehearse"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120, preexec_fn=enter)  # fmt: skip


@pytest.fixture
def limited():
    """A cgroup v1 memory group; the test writes its limit. Removed afterwards (its processes have exited)."""
    group = MEMORY_CGROUP / f"orch-test-memory-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        group.rmdir()


@pytest.mark.cli
@pytest.mark.root
@pytest.mark.skipif(not (MEMORY_CGROUP / "memory.limit_in_bytes").exists(), reason="needs cgroup v1's memory "
                    "controller")
def test_head_node_refuses_a_load_over_its_cgroup_memory_limit_that_its_memtotal_would_hold(limited):
    (limited / "memory.limit_in_bytes").write_text(str(768 * 1024**2))
    refused = rehearse(SETUP_ENV, cgroup=limited, path="/usr/bin:/bin")  # no nvidia-smi: host memory only
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert re.fullmatch(
        r"orch: error: loading needs ~0\.9 GiB of host memory on the busiest node \(every rank reads the whole "
        r"checkpoint and moves it to its GPU\), more than 90% of the 0\.75 GiB of this node's cgroup memory limit "
        r"\(a Slurm job's --mem, a container's limit\); set `memory: 2\+` under resources in the recipe \(SkyPilot "
        r"then plans a node with at least that much\)\n",
        refused.stderr,
    )
    assert "rehearsal" not in refused.stdout  # refused before the rehearsal (and beside it, the download) went on

    (limited / "memory.limit_in_bytes").write_text(str(2 * 1024**3))
    fits = rehearse(SETUP_ENV, cgroup=limited, path="/usr/bin:/bin")
    assert fits.returncode == 0, fits.stderr
    assert re.fullmatch(
        r"\[orch\] memory \(DDP, 2 x 8\): GPU unchecked \(no nvidia-smi\); host memory at load: ~0\.9 GiB on the "
        r"busiest node, fits 2 GiB \(this node's cgroup memory limit \(a Slurm job's --mem, a container's limit\)\)\n"
        # node/disk_room.py: the download, 4 DDP checkpoints (save_total_limit 3) and the final model, here one disk
        r"\[orch\] disk: ~13\.8 GB of [\d.]+ [GT]B free at \S+ \(the model's download 1\.0 GB still to come; 4 "
        r"checkpoints 11\.9 GB; the final model 1\.0 GB\)\n"
        r"\[orch\] rehearsal: skipped \(ORCH_REHEARSAL=off\)\n", fits.stdout), fits.stdout  # fmt: skip

    (limited / "memory.limit_in_bytes").write_text(str(768 * 1024**2))
    waived = rehearse({**SETUP_ENV, "ORCH_MEMORY_CHECK": "off"}, cgroup=limited, path="/usr/bin:/bin")
    assert waived.returncode == 0 and "memory: not checked (ORCH_MEMORY_CHECK=off)" in waived.stdout


def _nvidia_smi(tmp_path: Path, lines: str) -> str:
    """A directory holding an `nvidia-smi` that answers the query node/memory.py makes, and a PATH with it first."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "--query-gpu=name,memory.total --format=csv,noheader,nounits" ] || exit 9\n'
        f"printf '{lines}'\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return f"{tmp_path}:/usr/bin:/bin"


@pytest.mark.cli
def test_head_node_refuses_a_step_over_its_own_gpus_memory(tmp_path):
    """`sky launch recipes/qwen25_sft_ddp.yaml --gpus T4:8`: the launch side never saw T4s; the head node does."""
    env = {**SETUP_ENV, "TRL_OVERRIDES": "per_device_train_batch_size=64"}
    t4 = rehearse(env, path=_nvidia_smi(tmp_path, "Tesla T4, 15360\\nTesla T4, 15360\\n"))
    assert t4.returncode == 2, t4.stdout + t4.stderr
    assert re.match(r"orch: error: 0\.494B sft \(full, 64 x 2048 tokens per device\) needs ~20\.\d GiB per GPU .* "
                    r"under DDP on 16 GPU\(s\), more than one Tesla T4 holds \(15 GiB\); set "
                    r"per_device_train_batch_size=32 gradient_accumulation_steps=2 \(~13\.\d GiB; the same 1024 "
                    r"samples a step\), or use L4 \(24 GiB\); `orch plan` lists what fits\n",
                    t4.stderr)  # fmt: skip

    h100 = rehearse(env, path=_nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3, 81559\\nNVIDIA H100 80GB HBM3, 81559\\n"))
    assert h100.returncode == 0, h100.stderr
    assert re.match(r"\[orch\] memory \(DDP, 2 x 8\): ~20\.\d GiB per GPU training, ~0\.9 GiB loading, fits 79\.65 GiB "
                    r"\(NVIDIA H100 80GB HBM3\); host memory at load: ~0\.9 GiB on the busiest node, fits [\d.]+ GiB "
                    r"\(this node's MemTotal\)\n", h100.stdout)  # fmt: skip


@pytest.mark.cli
def test_head_node_refuses_a_4bit_load_that_more_nodes_do_not_help(tmp_path):
    """4-bit: every rank quantises the whole 70B onto its own GPU (~40 GiB at 1 x 4096 tokens on 16), whatever the
    count."""
    env = {**SETUP_ENV, "TRL_CONFIG": "recipes/trl/llama3_70b_qlora.yaml",
           "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_llama.yaml", "TRL_OVERRIDES": "per_device_train_batch_size=1",
           "SKYPILOT_SETUP_NODE_IPS": "\n".join(f"10.0.0.{i}" for i in range(1, 9))}  # fmt: skip
    l4 = rehearse(env, path=_nvidia_smi(tmp_path, "NVIDIA L4, 23034\\n"))
    assert l4.returncode == 2, l4.stdout + l4.stderr
    assert re.match(r"orch: error: loading needs ~\d\d\.\d GiB per GPU \(4-bit: every rank quantises the whole model "
                    r"onto its own GPU .*\), more than one NVIDIA L4 holds \(22\.49 GiB\); use ",
                    l4.stderr)  # fmt: skip


@pytest.mark.unit
def test_smallest_gpu_reads_nvidia_smis_csv_lines():
    assert memory.smallest_gpu("NVIDIA A100-SXM4-80GB, 81920\nNVIDIA A100-SXM4-40GB, 40960\n") == (
        40.0, "NVIDIA A100-SXM4-40GB")  # fmt: skip
    assert memory.smallest_gpu("") is None
    assert memory.smallest_gpu("No devices were found\n") is None


@pytest.mark.unit
def test_cgroup_limit_is_the_lowest_over_the_group_and_its_ancestors(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       32768000 kB\nMemFree:  1 kB\n")
    # cgroup v1: the job's group under a parent with a lower limit
    (proc / "self" / "cgroup").write_text("4:memory:/slurm/uid_0/job_7\n3:cpu:/\n0::/\n")
    job = root / "memory" / "slurm" / "uid_0" / "job_7"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{16 * GIB}\n")
    (root / "memory" / "slurm" / "memory.limit_in_bytes").write_text(f"{12 * GIB}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    assert memory.cgroup_limit(proc, root) == 12 * GIB
    gib, whose = memory.host_memory(proc, root)
    assert gib == 12 and "cgroup memory limit" in whose
    # cgroup v2, seen from a container whose group is the mount's root: `max` is no limit, MemTotal stands
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/c1\n")
    (root / "memory.max").write_text("max\n")
    assert memory.cgroup_limit(proc, root) is None
    assert memory.host_memory(proc, root) == (32768000 * 1024 / GIB, "this node's MemTotal")
    (root / "memory.max").write_text(f"{8 * GIB}\n")
    assert memory.host_memory(proc, root)[0] == 8


@pytest.mark.unit
@pytest.mark.parametrize("key", ["max_length", "per_device_train_batch_size", "dtype", "lora_r", "lora_dropout",
                                 "lora_target_modules", "use_peft", "load_in_4bit", "beta", "model_name_or_path",
                                 "gradient_checkpointing", "max_completion_length", "max_prompt_length"])  # fmt: skip
def test_a_setting_of_the_wrong_type_is_left_to_trls_parser_not_a_traceback(key, tmp_path, monkeypatch, request):
    """Plain `sky launch` brings the TRL config unchecked (orch run checks it against TRL's schema on the laptop):
    the memory check runs before the rehearsal, whose TRL parser names the bad value, so it must not crash first.
    A name that is no local path is answered as an offline Hub answers it, without asking (4 s of retries here)."""
    from orchestrator.core import configs
    from orchestrator.core.errors import OrchError
    from orchestrator.node import model_config

    monkeypatch.setattr(model_config, "_from_hub", lambda model, revision: model_config.Found(None, "offline"))
    model_config.forget()
    request.addfinalizer(model_config.forget)  # its cache holds this test's answers: gone with it

    paired = configs.load({"TRL_CONFIG": "recipes/trl/qwen25_sft.yaml", "ACCELERATE_CONFIG": "multi_gpu"}, ROOT)
    (tmp_path / "config.json").write_text('{"hidden_size": "wide"}')
    for trainer in ("sft", "grpo"):
        for bad in ("long", -3, 0, [], {}, "float8", [1, 2], True, str(tmp_path)):
            try:
                said = memory.check({"ORCH_DEVICE": "cpu"}, trainer, {**paired.trl, key: bad}, paired.accelerate, 2, 8)
            except OrchError as refused:  # a refusal is fine where the value is of its type (a huge batch)
                said = str(refused)
            assert said.startswith(("memory", "loading", "CPU offload")) or "needs" in said, (key, bad, said)
