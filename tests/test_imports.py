"""The launch side and `orch node --print` never import the training stack or SkyPilot.

Not a timing test: it checks what is imported, which is what makes these commands fast.
"""

import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.cli

HEAVY = ("torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "sky")
PROBE = """
import io, sys, contextlib
from orchestrator.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("CODE", code, "HEAVY", heavy)
"""
NODE_ENV = {
    "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "TRL_TRAINER": "dpo", "TRL_CONFIG": "recipes/trl/phi3_dpo.yaml",
    "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_phi3.yaml", "GLOBAL_BATCH_SIZE": "64",
}  # fmt: skip


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--help"], {}),
        (["ls"], {}),
        (["show", "qwen3_sft_fsdp_cp", "learning_rate=1e-6"], {}),
        (["node", "--print"], NODE_ENV),
        (["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--nodes", "2", "--dry-run", "--skip-optimizer"], {}),
        (["run", "qwen25_grpo_vllm_server", "--dry-run", "--skip-optimizer"], {}),
    ],
    ids=["help", "ls", "show", "node-print", "dry-run", "dry-run-vllm"],
)
def test_command_imports_nothing_heavy(argv, env):
    import os

    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr
    assert "CODE 0" in result.stdout, result.stdout + result.stderr


def test_the_stacks_versions_read_from_folder_names_are_importlib_metadatas(tmp_path, monkeypatch):
    """rehearsal.driver.versions reads `<name>-<version>.dist-info` folder names along sys.path instead of importing
    importlib.metadata and parsing METADATA (a third of a dry run): the same answer, here and with a shadowing
    install first on the path (another spelling of the name), and importlib.metadata for what has no such folder."""
    import importlib.metadata

    from orchestrator.rehearsal import driver

    def metadata() -> dict[str, str]:
        out = {}
        for name in driver.STACK:
            with __import__("contextlib").suppress(importlib.metadata.PackageNotFoundError):
                out[name] = importlib.metadata.version(name)
        return out

    assert driver.versions() == metadata() and driver.versions()["trl"]
    shadow = tmp_path / "Torch-9.9.9.dist-info"  # an older installer's spelling of torch's folder
    shadow.mkdir()
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert driver.versions()["torch"] == "9.9.9" == metadata()["torch"]
    egg = tmp_path / "eggy-1.2.egg-info"  # no dist-info folder: importlib.metadata's own answer
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: eggy\nVersion: 1.2\n")
    importlib.invalidate_caches()
    monkeypatch.setattr(driver, "STACK", (*driver.STACK, "eggy", "absent-package"))
    assert driver.versions()["eggy"] == "1.2" == metadata()["eggy"] and "absent-package" not in driver.versions()
