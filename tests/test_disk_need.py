"""The launch side's disk check (core/disk_need.py, launch/preflight.check_disk): the model's download and what the
checkpoints leave on a node's disk at once, against resources.disk_size, before anything is provisioned. The bytes a
strategy writes are measured for real in tests/test_trainers_smoke.py (tests/checkpoint_bytes.py)."""

from pathlib import Path

import pytest
from conftest import orch

from orchestrator.core import disk_need, memory, models
from orchestrator.core.accelerate_config import AccelerateConfig
from orchestrator.launch import preflight
from orchestrator.launch import recipe as recipes
from orchestrator.launch.resolved import resolve

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
LLAMA8 = models.KNOWN_ARCHS["meta-llama/llama-3.1-8b-instruct"]
FSDP2 = AccelerateConfig.of({"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2}})
FSDP1_FULL = AccelerateConfig.of({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}})
ZERO2 = AccelerateConfig.of({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}})
ZERO3 = AccelerateConfig.of({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}})


def setup(strategy: str, **kw) -> memory.Setup:
    return memory.Setup(arch=LLAMA8, strategy=strategy, gpus=16, weights_dtype="bfloat16", **kw)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_fits_its_disk_as_shipped(name, monkeypatch):
    """Each recipe at its own shape, checkpoints on its bucket: what the nodes' disks hold stays within disk_size."""
    monkeypatch.chdir(ROOT)
    launch = resolve(recipes.load(name))
    nodes = launch.recipe.num_nodes - (1 if "vllm_server" in name else 0)
    need = preflight.disk(launch, preflight.setup_of(launch, launch.gpus.count * nodes), nodes)
    assert need is not None and need.fits and need.where.endswith("(MOUNT_CACHED)"), need and need.describe()
    assert need.download == models.arch_of(str(launch.settings["model_name_or_path"])).params * 2  # bf16 files


def test_where_each_strategy_writes_its_checkpoint():
    p = LLAMA8.params
    fsdp = disk_need.checkpoint(setup("fsdp", mixed_precision=True), 2, FSDP2, {})
    assert fsdp.weights == [p * 4 / 2] * 2 and fsdp.optimizer == [p * 8 / 2] * 2  # fp32 upcast, sharded by DCP
    full = disk_need.checkpoint(setup("fsdp", mixed_precision=False), 2, FSDP1_FULL, {})
    assert full.weights == [p * 2, 0] and full.optimizer == [p * 4, 0]  # rank 0 gathers both (FSDP1's default)
    zero2 = disk_need.checkpoint(setup("zero2"), 2, ZERO2, {})
    assert zero2.weights == [p * 2 * 2, 0] and zero2.optimizer == [p * 12 / 2] * 2  # two copies of the weights
    zero3 = disk_need.checkpoint(setup("zero3"), 2, ZERO3, {})
    assert zero3.weights == [0, 0] and zero3.optimizer == [p * 12 / 2] * 2  # no 16-bit gather: no weights file
    only = disk_need.checkpoint(setup("ddp"), 2, AccelerateConfig.of({"distributed_type": "MULTI_GPU"}),
                                {"save_only_model": "true"})  # fmt: skip
    assert only.weights == [p * 2, 0] and only.optimizer == [0, 0]
    adapter = setup("ddp", method="lora", lora_targets=("all-linear",))
    lora = disk_need.checkpoint(adapter, 2, AccelerateConfig.of({"distributed_type": "MULTI_GPU"}), {})
    assert lora.weights == [memory.trained_params(adapter) * 4, 0] and lora.total < p / 10  # the fp32 adapter only


def test_kept_checkpoints_count_only_where_they_stay_on_the_disk():
    s = setup("fsdp", mixed_precision=True)
    kw = dict(where="somewhere", disk_gb=150, download_bytes=2)
    on_disk = disk_need.need(s, 2, FSDP2, {"save_total_limit": 2}, medium="disk", **kw)
    cached = disk_need.need(s, 2, FSDP2, {"save_total_limit": 2}, medium="cache", **kw)
    remote = disk_need.need(s, 2, FSDP2, {"save_total_limit": 2}, medium="remote", **kw)
    share = LLAMA8.params * 12 / 2
    assert (on_disk.kept, on_disk.checkpoints, on_disk.final) == (3, 3 * share, LLAMA8.params * 2)
    assert (cached.kept, cached.checkpoints, cached.final) == (1, share, 0)
    assert (remote.checkpoints, remote.total) == (0, LLAMA8.params * 2)  # the download alone
    assert on_disk.node == 0 and not on_disk.fits and cached.fits


def test_stored_dtype_comes_from_config_json():
    assert disk_need.stored_bytes({"torch_dtype": "float32"}) == 4
    assert disk_need.stored_bytes({"dtype": "bfloat16"}) == 2
    assert disk_need.stored_bytes({"text_config": {"dtype": "float32"}}) == 4
    assert disk_need.stored_bytes(None) == disk_need.stored_bytes({"dtype": "auto"}) == 2


@pytest.mark.e2e
def test_a_run_that_outgrows_its_disk_is_refused_before_launch_and_the_flag_fixes_it():
    """8B full SFT, checkpoints on the node's own disk: 3 kept (save_total_limit 2) of 96 GB, the download and the
    final model outgrow 256 GB. Refused with the figures and the fixes; --disk-size makes room; the knob shows it."""
    base = ["run", "llama3_sft_fsdp", "--nodes", "1", "--env", "CHECKPOINT_ROOT=", "--secret", "HF_TOKEN=x",
            "--dry-run", "--skip-optimizer", "--no-rehearsal"]  # fmt: skip
    env = {"ORCH_DATA_CHECK": "off", "ORCH_KERNEL_CHECK": "off"}
    refused = orch(*base, env=env)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("orch: error: node 0's disk is too small for this run: ~321.2 GB at once (the model's "
                           "download 16.1 GB; 3 checkpoints (save_total_limit 2"), line  # fmt: skip
    assert "against resources.disk_size 256 GB; give --disk-size 448 " in line
    assert "keep fewer checkpoints (save_total_limit=1)" in line and "checkpoint to a bucket" in line
    grown = orch(*base, "--disk-size", "448", env=env)
    assert grown.returncode == 0, grown.stderr[-2000:]
    assert "disk: ~321.2 GB on node 0's disk at most" in grown.stdout and "disk_size: 448" in grown.stdout
    shown = orch(*base, "--env", "ORCH_DISK_CHECK=off", env=env)
    assert shown.returncode == 0 and "(ORCH_DISK_CHECK=off: shown, not enforced)" in shown.stdout, shown.stderr[-2000:]
    bad = orch(*base, "--disk-size", "0", env=env)
    assert bad.returncode == 2 and "--disk-size 0: give each node's disk in GB, 1 or more" in bad.stderr

