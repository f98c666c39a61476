"""A finished local run's checkpoint against core/disk_need's estimate for the settings its launch line gave: the
bytes of its weights and of its optimizer state, each within a tenth (tests/test_trainers_smoke.py, every strategy)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from orchestrator.core import disk_need, fit
from orchestrator.core.accelerate_config import AccelerateConfig

WEIGHTS = re.compile(r"(^|/)(model.*\.safetensors|adapter_model\.safetensors|pytorch_model_fsdp_0/.*|"
                     r"global_step\d+/.*model_states\.pt)$")  # fmt: skip
OPTIMIZER = re.compile(r"(^|/)(optimizer\.(pt|bin)|optimizer_0/.*|global_step\d+/.*optim_states\.pt)$")


def measured(checkpoint: Path) -> tuple[int, int]:
    """(weights, optimizer state) bytes of a checkpoint's files, by name."""
    sizes = {p.relative_to(checkpoint).as_posix(): p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}
    return (sum(n for k, n in sizes.items() if WEIGHTS.search(k)),
            sum(n for k, n in sizes.items() if OPTIMIZER.search(k)))  # fmt: skip


def estimated(stdout: str, project: Path) -> tuple[disk_need.Checkpoint, float]:
    """core/disk_need's checkpoint for the run whose launch line (node 0's) `stdout` holds, as the launch side would
    estimate it, and its final model's bytes: the TRL config with the line's overrides, the Accelerate config and the
    model's config.json."""
    line = next(x for x in stdout.splitlines() if x.startswith("(node0) [orch] launch: "))
    argv = shlex.split(line.split("launch: ", 1)[1])
    accel_path = argv[argv.index("--config_file") + 1]
    nodes = int(argv[argv.index("--num_machines") + 1])
    world = int(argv[argv.index("--num_processes") + 1])
    accel = yaml.safe_load((project / accel_path).read_text())  # an absolute path stays itself
    if "--mixed_precision" in argv[: argv.index("--module")]:
        accel["mixed_precision"] = argv[argv.index("--mixed_precision") + 1]
    script = argv[argv.index("--module") + 3:]  # after `orchestrator.train <trainer>`
    trainer = argv[argv.index("--module") + 2]
    settings = yaml.safe_load((project / script[script.index("--config") + 1]).read_text())
    given: set[str] = set()
    key = ""
    for word in script:  # --key value, or --key value value... (reward_funcs)
        if word.startswith("--"):
            key = word[2:]
        elif key != "config":
            had = settings.get(key) if key in given else None
            value = yaml.safe_load(word)
            settings[key] = value if had is None else [*(had if isinstance(had, list) else [had]), value]
            given.add(key)
    model = Path(settings["model_name_or_path"])
    config = json.loads((model / "config.json").read_text())
    parsed = AccelerateConfig.of(accel)
    setup = fit.setup_of(trainer, settings, parsed, world, config, str(model / "config.json"))
    assert setup is not None
    return disk_need.checkpoint(setup, nodes, parsed, settings), disk_need.final_bytes(setup)


def tensors(output_dir: Path) -> int:
    """Tensors the run trained: those of its final model's file (the whole model, or the adapter)."""
    from safetensors import safe_open

    files = [p for p in output_dir.glob("*.safetensors")]
    count = 0
    for path in files:
        with safe_open(str(path), "pt") as fh:
            count += len(list(fh.keys()))
    return count


FRAMING = 2500
"""Bytes a file format adds per tensor and rank beyond the tensor's own (torch.distributed.checkpoint's and
torch.save's framing: measured under 2 KB): a tiny model's tensors are small enough for it to show, a real one's not."""


def check(stdout: str, project: Path, output_dir: Path) -> None:
    """checkpoint-8's weights and optimizer state, and the final model, each within 3% of the estimate, beyond the
    files' framing (an estimate that took bf16 for fp32, or missed a copy, is off by the whole tensor bytes)."""
    ckpt, final = estimated(stdout, project)
    weights, optimizer = measured(output_dir / "checkpoint-8")
    entries = tensors(output_dir) * 2  # each of the 2 ranks' share of every trained tensor
    report = json.loads((output_dir / "orch" / "rank0.json").read_text())["final_model"]["bytes"]
    for what, real, guess, framing in (("weights", weights, sum(ckpt.weights), entries),
                                       ("optimizer state", optimizer, sum(ckpt.optimizer), 3 * entries),
                                       ("final model", report, final, entries // 2)):  # fmt: skip
        assert 0.97 * guess <= real <= 1.03 * guess + FRAMING * framing, (what, real, guess, ckpt)
