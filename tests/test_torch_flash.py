"""bench/torch_flash, gpu-check's stand-in for the Kernels Hub's flash-attn2 made of PyTorch's own FlashAttention
kernels: on CPU (where it computes with SDPA's math) this checks the plumbing the GPU run relies on, that a model asking
for `kernels-community/flash-attn2` reaches it through `kernels`' LOCAL_KERNELS override and transformers' Hub-kernel
path, that a packed row goes through its varlen function with the documents' cumulative lengths, and that the loss
then equals the unpacked documents'. The kernel itself runs only under `make gpu-check` (docs/gpu.md)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[2])
import ulysses_packing as up

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="kernels-community/flash-attn2")
kernel = sys.modules["orch_torch_flash"]  # imported by kernels' get_local_kernel under its metadata id
calls = []
real = kernel.flash_attn_varlen_func
import functools
@functools.wraps(real)  # transformers passes what the signature names
def counted(q, k, v, cu_seqlens_q, *a, **kw):
    calls.append(cu_seqlens_q.tolist())
    return real(q, k, v, cu_seqlens_q, *a, **kw)
kernel.flash_attn_varlen_func = counted
import transformers.modeling_flash_attention_utils as fa
fa._loaded_implementation = None  # re-read the kernel's functions on the next forward
generator = torch.Generator().manual_seed(1)
documents = [torch.randint(5, 200, (n,), generator=generator).tolist() for n in (20, 4, 4, 4)]
batch = up.packed_batch(documents)
shift = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
loss, count = up.token_losses(model, batch["input_ids"], batch["position_ids"], shift)
print("RESULT " + json.dumps({"packed": (loss / count).item(), "unpacked": up.unpacked(model, documents),
                              "varlen_calls": calls[:1], "implementation": model.config._attn_implementation}))
"""


def test_a_model_asking_for_flash_attn2_reaches_the_stand_in_and_keeps_packed_documents_apart(tiny_qwen3):
    env = {"LOCAL_KERNELS": f"kernels-community/flash-attn2={ROOT / 'bench' / 'torch_flash'}", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_qwen3), str(ROOT / "tests")], cwd=ROOT,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert result["implementation"] == "kernels-community/flash-attn2", result
    # transformers found the four documents in position_ids and called the varlen function with their bounds
    assert result["varlen_calls"] == [[0, 20, 24, 28, 32]], result
    assert result["packed"] == pytest.approx(result["unpacked"], abs=1e-4), result


def test_the_stand_in_refuses_what_flash_attn_would_do_and_it_cannot():
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    import torch_flash

    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for kwargs in ({"dropout_p": 0.1}, {"window_size": (16, 0)}, {"softcap": 30.0}):
        with pytest.raises(NotImplementedError, match="stand-in"):
            torch_flash.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True, **kwargs)
