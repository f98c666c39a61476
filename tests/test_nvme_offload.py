"""DeepSpeed's offload to NVMe (ZeRO-Infinity: offload_param_device / offload_optimizer_device nvme): the states CPU
offload keeps in host memory go to swap files in the nvme_path, through DeepSpeed's async_io op, which it JIT-builds
against the node's libaio. Before, orch counted them as host memory (a refusal asking for ~105 GiB of RAM a node did
not need), the laptop's rehearsal built async_io against the laptop's libaio (refused where the nodes had it), a
missing nvme_path swapped to ./none on the boot disk, and a node without libaio failed after its launch. The
rehearsals, laptop and head node: tests/test_rehearsal.py (in its findings' batch)."""

import json
import os
import re
import subprocess
import sys

import pytest

from orchestrator.core import configs, fit, host_fit, memory
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.core.errors import OrchError
from orchestrator.node import disk_room, rules

pytestmark = pytest.mark.unit

ZERO3 = {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
         "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True, "offload_param_device": "cpu",
                              "offload_optimizer_device": "cpu"}}  # fmt: skip


def zero3(**offload: str) -> AccelerateConfig:
    return AccelerateConfig.of({**ZERO3, "deepspeed_config": {**ZERO3["deepspeed_config"], **offload}})


def setup_of(accel: AccelerateConfig, gpus: int = 8) -> memory.Setup:
    paired = configs.load({"TRL_CONFIG": "recipes/trl/llama3_sft.yaml", "ACCELERATE_CONFIG": "multi_gpu"})
    setup = fit.setup_of("sft", paired.trl, accel, gpus)
    assert setup is not None
    return setup


@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "cpu")])
def test_what_goes_to_nvme_is_not_host_memory_and_the_two_add_up_to_cpu_offloads(param, optimizer):
    """Llama-3.1-8B under ZeRO-3 with offload, 8 GPUs on 2 nodes: host memory and NVMe split CPU offload's figure by
    what each offload moves (the weights, the optimizer's fp32 copy and moments), the GPU's share unchanged."""
    paths = {f"offload_{p}_nvme_path": "/local_nvme" for p, d in (("param", param), ("optimizer", optimizer))
             if d == "nvme"}  # fmt: skip
    setup = setup_of(zero3(offload_param_device=param, offload_optimizer_device=optimizer, **paths))
    cpu = setup_of(zero3())
    host, nvme = host_fit.offloaded_gib(setup, 2), host_fit.nvme_gib(setup, 2)
    assert host + nvme == pytest.approx(host_fit.offloaded_gib(cpu, 2)) and host_fit.nvme_gib(cpu, 2) == 0
    assert memory.estimate(setup).gib == pytest.approx(memory.estimate(cpu).gib)  # the GPUs hold the same
    parts = host_fit.nvme_parts(setup, 2)
    assert set(parts) == {p for p, d in (("param", param), ("optimizer", optimizer)) if d == "nvme"}
    if set(parts) == {"param", "optimizer"}:
        assert host == 0 and parts["optimizer"] > parts["param"] > 0  # 12 bytes a parameter against 2
    where = {0: "CPU", 1: "CPU and NVMe", 2: "NVMe"}[len(parts)]
    assert fit.label(setup) == f"ZeRO-3 with {where} offload"


def test_nvme_without_a_path_is_refused_before_it_swaps_to_a_folder_named_none():
    """accelerate passes the word "none" where no nvme_path is given, which DeepSpeed's config takes as a relative
    path (read back below): the swap files would fill ./none on the boot disk."""
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    assert str(DeepSpeedZeroOffloadParamConfig(device="nvme", nvme_path="none").nvme_path) == "none"
    with pytest.raises(OrchError, match=r"^a.yaml: offload_param_device nvme with no path to swap to: DeepSpeed "
                       r"would write its swap files to \./none on the boot disk; set "
                       r"deepspeed_config\.offload_param_nvme_path"):  # fmt: skip
        rules.check_nvme_paths(zero3(offload_param_device="nvme"), "a.yaml")
    rules.check_nvme_paths(zero3(offload_param_device="nvme", offload_param_nvme_path="/local_nvme"), "a.yaml")
    rules.check_nvme_paths(zero3(), "a.yaml")
    # a DeepSpeed JSON's own nvme_path, read as accelerate's plugin reads it
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}  # fmt: skip
    from orchestrator.core.accelerate_config import with_deepspeed_json

    json_config = with_deepspeed_json(AccelerateConfig.of({"distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": "ds.json"}}), ds, "ds.json")  # fmt: skip
    assert json_config.nvme_paths == {"param": "/nvme", "optimizer": "none"}
    with pytest.raises(OrchError, match=r"set zero_optimization\.offload_optimizer\.nvme_path in its DeepSpeed JSON"):
        rules.check_nvme_paths(json_config, "b.yaml")


def test_the_laptops_rehearsal_swaps_nvme_for_cpu_offload_in_accelerates_environment_and_json(tmp_path):
    """rehearsal/role.nvme_as_cpu: the devices accelerate exports, or a copy of the DeepSpeed JSON (its other keys
    kept), in a scratch folder the role removes; nothing where nothing goes to NVMe."""
    from orchestrator.rehearsal.role import nvme_as_cpu

    child = {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme",
             "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}  # fmt: skip
    assert nvme_as_cpu(child, tmp_path) == ("param offload to NVMe rehearsed as CPU offload (the head node rehearses "
                                            "NVMe)")  # fmt: skip
    assert child["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu" and not list(tmp_path.iterdir())
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path":
                  "/nvme", "buffer_count": 5}}, "train_batch_size": "auto"}))  # fmt: skip
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    child = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds)}
    assert nvme_as_cpu(child, scratch).startswith("optimizer offload to NVMe rehearsed as CPU offload")
    copy = json.loads((scratch / "ds.json").read_text())
    assert child["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(scratch / "ds.json")
    assert copy["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "nvme_path": "/nvme", "buffer_count": 5}
    assert json.loads(ds.read_text())["zero_optimization"]["offload_optimizer"]["device"] == "nvme"  # theirs kept
    assert nvme_as_cpu({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}, scratch) == ""


def test_the_head_node_checks_the_nvme_path_is_there_and_has_room(tmp_path):
    """node/disk_room.py: a path that is not a directory (an NVMe not mounted: DeepSpeed would make the folder on
    the boot disk), and the swap files counted on the file system under the path, with the checkpoints where they
    share it."""
    settings = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16"}
    missing = tmp_path / "nvme"
    accel = zero3(offload_param_device="nvme", offload_optimizer_device="nvme", offload_param_nvme_path=str(missing),
                  offload_optimizer_nvme_path=str(missing))  # fmt: skip
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HOME": str(tmp_path)}
    argv = ["--output_dir", str(tmp_path / "run")]
    with pytest.raises(OrchError, match=rf"^offload_optimizer_nvme_path {missing} is not a directory on this node: "
                       r"DeepSpeed would make it on / and swap there"):  # fmt: skip
        disk_room.check(env, "sft", settings, accel, argv, 1, 4)
    missing.mkdir()
    line = disk_room.check(env, "sft", settings, accel, argv, 1, 4)
    assert re.search(r"DeepSpeed's optimizer swap files [1-9]\.\d GB \(offload to nvme\); DeepSpeed's param swap files "
                     r"[\d.]+ [MG]B \(offload to nvme\)\)$", line), line


PROBE = """
import contextlib, io, json
from orchestrator.rehearsal import data, probes

def attempt(capture) -> str:
    try:
        with capture():
            probes.async_io()
    except RuntimeError as exc:
        return str(exc)
    return "ok"

print(json.dumps({"rank": attempt(contextlib.nullcontext), "rehearsal": attempt(data.quiet),
                  "stringio": attempt(lambda: contextlib.redirect_stderr(io.StringIO()))}))
"""


@pytest.mark.e2e
def test_the_head_nodes_libaio_check_answers_in_the_rehearsal_as_in_a_rank_and_builds_nothing(tmp_path):
    """The head node rehearses NVMe offload as it is: DeepSpeed's own libaio check first (rehearsal/probes.async_io).
    Its check compiles and links a call to io_submit with -laio, its stderr's file descriptor redirected, which failed
    on the StringIO the rehearsal's roles printed into: "Unable to JIT load the async_io op" and `apt-get install
    libaio-dev` on a head node that had it (seen with libaio-dev installed here). A stand-in libaio (LDFLAGS) gives
    that machine on any machine. Where libaio is missing the refusal is DeepSpeed's own and comes before DeepSpeed's
    async_io load would build its pin_memory op (~100 s of CPU here, for nothing)."""
    stub = tmp_path / "lib"
    stub.mkdir()
    (stub / "aio.c").write_text("int io_submit(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(stub / "libaio.so"), str(stub / "aio.c")], check=True)
    probe = tmp_path / "probe.c"
    probe.write_text("void io_submit(void); int main(void) { io_submit(); return 0; }\n")
    has_libaio = subprocess.run(["cc", str(probe), "-laio", "-o", str(tmp_path / "a.out")],
                                capture_output=True).returncode == 0  # fmt: skip
    extensions = tmp_path / "torch_extensions"

    def probe_with(**env: str) -> dict:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions),
                                   **env})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    refusal = "Unable to JIT load the async_io op due to it not being compatible due to hardware/software issue."
    found = probe_with(LDFLAGS=f"-L{stub}")
    assert found["rank"] == found["rehearsal"] == "ok", found
    assert found["stringio"].startswith(refusal), found  # the trap the rehearsal's capture no longer sets
    found = probe_with()
    for where in ("rank", "rehearsal"):
        assert (found[where] == "ok") if has_libaio else found[where].startswith(refusal), (where, found)
    assert not extensions.exists() or not any(extensions.iterdir()), list(extensions.iterdir())  # nothing built
