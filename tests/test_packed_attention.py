"""Packed rows under Ulysses sequence parallelism, with the libraries' own code on CPU (tests/ulysses_packing.py):
DeepSpeed's Ulysses wrapper drops the attention mask, so on SDPA a packed row's documents attend to the ones before
them and the loss moves, with no error: what `node/rules.check_packed_attention` refuses (tests/test_node.py). An
attention that keeps the documents apart from position_ids, as flash attention's varlen kernel does on GPUs
(`make gpu-check` runs that kernel), gives the unpacked documents' loss through the same Ulysses chain."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e


def test_ulysses_on_sdpa_mixes_packed_documents_and_a_boundary_aware_attention_does_not(tiny_qwen3, tmp_path):
    ops = tmp_path / "ops"  # torch's extension builds: DeepSpeed's comm on CPU builds none (skip_shm_comm)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "ulysses_packing.py"), str(tiny_qwen3)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ops)})  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not ops.exists(), "DeepSpeed built an op on CPU: ulysses_packing.py lost its skip_shm_comm()"
    losses = json.loads(re.search(r"^LOSSES (.*)$", run.stdout, re.M).group(1))
    reference = losses["unpacked"]
    # without SP, transformers' SDPA mask keeps the documents apart (from position_ids; TRL passes use_cache=False)
    assert losses["packed_no_sp"] == pytest.approx(reference, abs=1e-4), losses
    # Ulysses SP2 on SDPA, the recipe's chain on CPU: the short documents attend to the long one before them, exactly
    # as causal attention over the whole row does
    assert abs(losses["ulysses_sdpa"] - reference) > 1e-3, losses
    assert losses["ulysses_sdpa"] == pytest.approx(losses["packed_mixed"], abs=1e-4), losses
    # the same chain on an attention that reads document starts from the gathered position_ids
    assert losses["ulysses_varlen"] == pytest.approx(reference, abs=1e-4), losses
