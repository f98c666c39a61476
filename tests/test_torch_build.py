"""A GPU node whose torch cannot use its GPUs is refused, not left to train: accelerate and transformers make each of
its processes a CPU process training alone (a world of 1), N copies of the run writing the same checkpoints on paid GPUs
(measured: two "GPU" processes on this CPU machine each trained steps 1-4, one then failed renaming the other's
checkpoint manifest). `orch node` refuses a CPU build of torch before it launches anything (core/torch_build.py, read
from torch's version file), every rank checks what only torch can say and reads its world back (train/devices.py),
and the node setup does not keep a CPU build on a node with NVIDIA GPUs (tests/test_node_setup.py)."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, free_port, orch

from orchestrator.core import cuda_arch, fit, torch_build
from orchestrator.core.accelerators import CUDA_CAPABILITY
from orchestrator.core.errors import OrchError

CUDA_VERSION_PY = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cu128'
debug = False
cuda: Optional[str] = '12.8'
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""


@pytest.mark.unit
def test_the_build_is_read_from_torchs_version_file_without_running_it():
    here = torch_build.installed()  # this machine's torch: the CPU build (test_node_setup checks it is the lock's)
    assert here is not None and here.cpu_only and here.version.endswith("+cpu"), here
    cuda = torch_build.parse(CUDA_VERSION_PY)
    assert cuda == torch_build.Build("2.13.0+cu128", "12.8", None) and not cuda.cpu_only
    rocm = torch_build.parse(CUDA_VERSION_PY.replace("'12.8'", "None").replace("hip: Optional[str] = None",
                                                                               "hip: Optional[str] = '7.0.51831'"))
    assert rocm is not None and not rocm.cpu_only and rocm.words() == "a ROCm (HIP 7.0.51831) build"
    # a file that is not torch's, or says nothing readable: no build, nothing refused on its account
    assert torch_build.parse("import os\n__version__ = os.environ['X']\n") is None
    assert torch_build.parse("def (:\n") is None
    assert torch_build.parse("__version__ = '2.13.0'\ncuda = __import__('os').system('false')\n").cpu_only


@pytest.mark.cli
def test_orch_node_refuses_a_cpu_build_of_torch_on_a_gpu_node_before_it_launches_anything(node_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ORCH_DEVICE"} | node_env(1, 2, 0) | {
        "ORCH_HOME": str(tmp_path), "CHECKPOINT_ROOT": str(tmp_path / "ckpt"), "SKYPILOT_TASK_ID": "sky-1"}
    done = orch("node", env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stdout + done.stderr  # one line, nothing launched
    assert done.stderr.startswith(f"orch: error: this node's torch {torch_build.installed().version} is a CPU build "
                                  "(no CUDA, no ROCm): it sees none of the GPUs, and each of the 2 GPU process(es) "
                                  "would train alone on the CPU; install a CUDA build of torch"), done.stderr
    assert "ORCH_DEVICE=cpu" in done.stderr and not (tmp_path / "ckpt").exists()


RANK_CHECKS = textwrap.dedent("""
    import json, types
    import torch
    from orchestrator.core import torch_build
    from orchestrator.train import devices
    said = {"cpu": devices.gpu_problem({"ORCH_DEVICE": "cpu", "LOCAL_WORLD_SIZE": "8"}),
            "this": devices.gpu_problem({"LOCAL_WORLD_SIZE": "8"}),
            "same": tuple(torch_build.installed()) == (torch.__version__, torch.version.cuda, torch.version.hip)}
    def too_old():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040). Please update your GPU "
                           "driver by downloading and installing a new version from the URL: "
                           "http://www.nvidia.com/Download/index.aspx")
    torch.version.cuda, torch.cuda.init = "12.8", too_old  # a CUDA build on a node whose driver is older than it
    said["driver"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "8"})
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 4)  # 4 GPUs seen, 8 processes
    said["fewer"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    said["enough"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "4"})
    # the lock's build (CUDA 13.0: kernels from 7.5) on a V100, then on an A100
    torch.cuda.get_arch_list = lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    torch.cuda.get_device_name = lambda index: "Tesla V100-SXM2-16GB"
    torch.cuda.get_device_capability = lambda index: (7, 0)
    torch.version.cuda = "13.0"
    said["v100"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    said["v100_anyway"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "4", "ORCH_CUDA_ARCH_CHECK": "off"})
    torch.cuda.get_device_capability = lambda index: (8, 0)
    said["a100"] = devices.gpu_problem({"LOCAL_WORLD_SIZE": "4"})
    args = types.SimpleNamespace(world_size=1, device="cpu",
                                 distributed_state=types.SimpleNamespace(distributed_type=types.SimpleNamespace(value="NO")))
    said["world"] = devices.world_problem(args, {"WORLD_SIZE": "16"})
    said["world_ok"] = devices.world_problem(args, {"WORLD_SIZE": "1"})
    said["no_torchrun"] = devices.world_problem(args, {})
    print(json.dumps(said))
""")


@pytest.mark.cli
def test_each_rank_names_why_torch_sees_no_gpu_in_torchs_own_words_and_a_world_that_is_not_torchruns():
    # one process (torch imported once): torch's CUDA answers replaced as a node without them would give them
    done = subprocess.run([sys.executable, "-c", RANK_CHECKS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["cpu"] is None and said["same"]  # CPU processes on purpose; the file says what torch says
    assert said["this"].startswith("this node's torch ") and "is a CPU build (no CUDA, no ROCm)" in said["this"]
    assert "each of the 8 GPU process(es) would train alone on the CPU" in said["this"]
    driver = ("(a CUDA 12.8 build) sees no GPU on this node (RuntimeError: The NVIDIA driver on your system is too old "
              "(found version 11040).")
    assert said["driver"].startswith("torch ") and driver in said["driver"], said["driver"]
    assert said["fewer"] == (
        "8 training processes on this node and torch sees 4 GPU(s) (CUDA_VISIBLE_DEVICES=0,1,2,3): each process needs "
        "a GPU of its own; the node's process count (SKYPILOT_NUM_GPUS_PER_NODE, or ORCH_GPUS_PER_NODE) must not "
        "exceed the GPUs torch sees")
    assert said["enough"] is None and said["a100"] is None and said["v100_anyway"] is None
    assert said["v100"] == (
        "GPU 3 (Tesla V100-SXM2-16GB, compute capability 7.0) has no kernels in torch 2.13.0+cpu (a CUDA 13.0 build "
        "for 7.5, 8.0, 8.6, 9.0, 10.0, 12.0): its first CUDA kernel would fail; install a build that has them in the "
        "ranks' environment (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126), or use an "
        "image holding one; ORCH_CUDA_ARCH_CHECK=off runs it anyway")
    assert said["world"] == ("torchrun started 16 processes and the trainer made a world of 1 (accelerate's "
                             "distributed type NO, device cpu): each process would train alone and write the same "
                             "checkpoints")
    assert said["world_ok"] is None and said["no_torchrun"] is None


@pytest.mark.e2e
def test_ranks_whose_world_is_not_the_one_torchrun_started_stop_before_training(tmp_path):
    """TRL's multi_gpu config on CPU processes (ORCH_DEVICE=cpu, launched without `orch node`, which would give them
    orch's cpu.yaml): accelerate's state says NO distributed type and each rank made a world of 1 where torchrun
    started 2. Read back from the ranks, they stop before the model loads; no checkpoint is written."""
    from orchestrator.core import smoke

    artifacts = smoke.plan("Qwen/Qwen2.5-0.5B-Instruct", "sft")
    smoke.ensure(artifacts)
    config = Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / (
        "site-packages/trl/accelerate_configs/multi_gpu.yaml")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
            "--num_machines", "1", "--main_process_port", str(free_port()), "--module", "orchestrator.train", "sft",
            "--config", "recipes/trl/qwen25_sft.yaml", "--model_name_or_path", str(artifacts.dir / "model"),
            "--dataset_name", str(artifacts.dir / "data"), "--dtype", "float32", "--bf16", "false", "--max_steps", "2",
            "--report_to", "none", "--use_liger_kernel", "false", "--attn_implementation", "sdpa",
            "--output_dir", str(out)]  # fmt: skip
    env = {**os.environ, "ORCH_DEVICE": "cpu", "ORCH_NETCHECK": "off"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode != 0, done.stdout[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("orch: error:")]
    assert lines and set(lines) == {"orch: error: torchrun started 2 processes and the trainer made a world of 1 "
                                    "(accelerate's distributed type NO, device cpu): each process would train alone "
                                    "and write the same checkpoints"}, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[orch] step" not in done.stdout and not any(out.glob("checkpoint-*"))


@pytest.mark.unit
def test_a_gpu_the_locked_torch_build_has_no_kernels_for_is_refused_before_launch():
    """uv.lock's torch 2.13.0 is the CUDA 13.0 build (its cuda-toolkit), whose x86_64 kernels start at 7.5 by torch's
    own table (tests/test_gpu_path.py compares the snapshot with it): a V100 passed every owner's check, then would
    have failed at the nodes' first kernel. Refused before launch, not where an image brings its own torch (each rank
    checks that one), and never offered by a memory refusal."""
    assert cuda_arch.table()["lock_cuda"] == "13.0"
    assert sorted(g for g in CUDA_CAPABILITY if not cuda_arch.runs_lock(g)) == ["V100", "V100-32GB"]
    assert cuda_arch.runs_lock("MI300X") and cuda_arch.runs_lock("GH200") and cuda_arch.host_of("GH200") == "aarch64"
    with pytest.raises(OrchError) as refused:
        cuda_arch.check_gpu("V100", {})
    assert str(refused.value) == (
        "V100 (compute capability 7.0) cannot run torch 2.13.0's CUDA 13.0 build, which the nodes install (uv.lock): "
        "its x86_64 kernels are for compute capability 7.5, 8.0, 8.6, 9.0, 10.0, 12.0 (torch's own table), so the "
        "first CUDA kernel on the nodes would fail ('no kernel image is available for execution on the device'); use "
        "a GPU of compute capability 7.5 or newer (T4, A100, A10 and newer), or an image holding torch 2.13.0's CUDA "
        "12.6 build (--image-id; the node setup keeps it); ORCH_CUDA_ARCH_CHECK=off launches it anyway")
    cuda_arch.check_gpu("V100", {}, image="docker:me/torch-cu126")  # the image's torch: each rank checks it
    cuda_arch.check_gpu("V100", {"ORCH_CUDA_ARCH_CHECK": "off"})
    assert fit.smallest_holding(26) == "A100"  # the V100-32GB holds 26 GiB, and cannot run


@pytest.mark.cli
def test_orch_run_refuses_a_v100_in_one_line_and_takes_an_image_with_its_own_torch(project, plan):
    argv = ["run", "qwen25_sft_ddp", "--gpus", "V100:1", "--dry-run", "--skip-optimizer", "bf16=false", "fp16=true",
            "dtype=float32"]  # fmt: skip
    refused = orch(*argv, cwd=project)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.startswith("orch: error: V100 (compute capability 7.0) cannot run torch 2.13.0's CUDA 13.0 "
                                     "build") and refused.stderr.count("\n") == 1, refused.stderr
    assert sorted(p.name for p in project.iterdir()) == ["recipes"]  # nothing written
    imaged = orch(*argv, "--image-id", "docker:me/torch-cu126", cwd=project)
    assert imaged.returncode == 0, imaged.stderr[-2000:]
    anyway = orch(*argv, "--env", "ORCH_CUDA_ARCH_CHECK=off", cwd=project)
    assert anyway.returncode == 0, anyway.stderr[-2000:]
    planned = plan("Qwen/Qwen2.5-0.5B-Instruct", "--dtype", "float32")
    assert re.search(r"^V100 +- +none: no kernels +16$", planned.stdout, re.M), planned.stdout
    assert "V100, V100-32GB: torch 2.13.0's CUDA 13.0 build, which the nodes install (uv.lock), has no kernels for " \
        "them: a launch there is refused, unless --image-id names an image holding its CUDA 12.6 build" in \
        planned.stdout  # fmt: skip


@pytest.mark.unit
def test_the_head_node_refuses_in_its_setup_gpus_its_torch_build_has_no_kernels_for():
    """`orch node --rehearse` (the setup, before the model downloads): nvidia-smi's lowest compute capability against
    the installed torch's CUDA build, by torch's release table, so plain `sky launch --gpus V100` stops there."""
    with pytest.raises(OrchError) as refused:
        cuda_arch.check_node((7, 0), "13.0", "x86_64", "2.13.0+cu130", {})
    assert str(refused.value) == (
        "this node's GPUs (compute capability 7.0) cannot run its torch 2.13.0+cu130, a CUDA 13.0 build with kernels "
        "for 7.5, 8.0, 8.6, 9.0, 10.0, 12.0 (torch's own table): the first CUDA kernel would fail; install a build "
        "that has them in the ranks' environment (pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu126), or use an image holding one; ORCH_CUDA_ARCH_CHECK=off runs it anyway")
    for fine in [((7, 0), "12.6", "x86_64"), ((9, 0), "13.0", "aarch64"), ((7, 5), "13.0.2", "x86_64"),
                 ((7, 0), "12.4", "x86_64"),  # a build torch's table does not list: each rank checks its own
                 ((7, 0), None, "x86_64"), (None, "13.0", "x86_64")]:  # fmt: skip
        cuda_arch.check_node(*fine, "2.13.0", {})
    cuda_arch.check_node((7, 0), "13.0", "x86_64", "2.13.0", {"ORCH_CUDA_ARCH_CHECK": "off"})
    with pytest.raises(OrchError, match=r"aarch64|use a newer GPU"):  # no ARM build of 12.6 has 7.0 kernels
        cuda_arch.check_node((7, 0), "13.0", "aarch64", "2.13.0", {})


NVIDIA_SMI_Q = """
==============NVSMI LOG==============

Timestamp                                 : Mon Apr 20 10:00:00 2026
Driver Version                            : 535.216.01
CUDA Version                              : 12.2

Attached GPUs                             : 8
GPU 00000000:10:1C.0
    Product Name                          : NVIDIA A100-SXM4-40GB
"""


@pytest.mark.unit
def test_the_head_node_refuses_a_torch_cuda_build_its_driver_does_not_run():
    """skypilot#9406: SkyPilot's AWS image had driver 535 (CUDA 12.2) and torch's cu130 wheel saw no GPU. The lock's
    torch is that build: the head node refuses it in its setup, naming the builds its driver runs."""
    from orchestrator.node import memory

    driver = memory.cuda_version(NVIDIA_SMI_Q)
    assert driver == (12, 2) and memory.cuda_version("Driver Version : 535.216.01\n") is None
    with pytest.raises(OrchError) as refused:
        cuda_arch.check_node((8, 0), "13.0", "x86_64", "2.13.0+cu130", {}, driver)
    assert str(refused.value) == (
        "this node's NVIDIA driver runs CUDA up to 12.2 (nvidia-smi), and its torch 2.13.0+cu130 is a CUDA 13.0 build, "
        "which needs a driver for CUDA 13: torch would see no GPU and every rank would stop; use an image with a newer "
        "driver, or install a build this driver runs in the ranks' environment (pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu126; pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu129; an image holding one is kept by the setup); ORCH_CUDA_ARCH_CHECK=off "
        "runs it anyway")
    with pytest.raises(OrchError, match=r"\(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/"
                                        r"cu126; an image holding"):  # a V100: only the 12.6 build has its kernels
        cuda_arch.check_node((7, 0), "13.0", "x86_64", "2.13.0", {}, driver)
    cuda_arch.check_node((8, 0), "13.0", "x86_64", "2.13.0", {}, (13, 0))  # driver 580
    cuda_arch.check_node((8, 0), "12.6", "x86_64", "2.13.0+cu126", {}, (12, 2))  # minor version compatibility
    cuda_arch.check_node((8, 0), "13.0", "x86_64", "2.13.0", {"ORCH_CUDA_ARCH_CHECK": "off"}, driver)
