"""TRL's fused LM head (trl/kernels/chunked_logprob.py), run on CPU under a count of live tensor bytes, against the
memory model's term for it (core/memory.lm_head).

Every trainer orch runs but the reward model scores tokens through this head, so the tokens x vocabulary logits never
exist whole: the head's peak is one tile, the hidden states' gradient and, when the head is trained, its weight's
gradient. On CPU the tile is folded by torch ops with temporaries of their own (a GPU folds it in place with Triton),
which are freed before the backward's end, where the peak the model counts lies: with a tile small beside the
gradients, the CPU's peak is the GPU's. TRL's tile (4096 tokens x 32768 vocabulary columns) is scaled down so each
case takes a fraction of a second; the first test pins the model's tile to TRL's.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core import memory

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("lm_head")]  # one worker: its module fixture measures once

TILE = (128, 512)  # tokens x vocabulary columns, for the measurements


def test_the_models_tile_is_trls():
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    assert memory.HEAD_TILE == (chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE)


CASES = [  # tokens, vocabulary, hidden size, head trained, bf16 autocast
    (1024, 4096, 1024, True, True),  # full fine-tuning in bf16: the head's fp32 gradient and its bf16 copy
    (1024, 4096, 1024, False, True),  # LoRA: the head is frozen, only the hidden states get a gradient
    (1024, 8192, 1024, False, True),  # twice the vocabulary, frozen head: the same peak (the tile bounds it)
    (2048, 4096, 1024, False, True),  # twice the tokens: only the hidden states' gradient grows
    (100, 4096, 1024, True, True),  # fewer tokens than a tile's rows
    (1024, 4096, 1024, True, False),  # fp32 without autocast: the gradients are not copied again
]


@pytest.fixture(scope="module")
def peaks() -> dict[tuple, int]:
    """Every case's peak, measured in one process of its own (tests/lm_head_probe.py)."""
    names = ("tokens", "vocab", "hidden", "trained", "autocast")
    cases = [dict(zip(names, c, strict=True), tile=list(TILE)) for c in CASES]
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("lm_head_probe.py")), json.dumps(cases)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(zip(CASES, json.loads(run.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_trls_fused_head_holds_what_the_memory_model_counts(peaks, case):
    tokens, vocab, hidden, trained, autocast = case
    measured = peaks[case]
    compute = 2 if autocast else 4
    parts = memory.lm_head(tokens, vocab, hidden, trained=trained, compute=compute, tile=TILE)
    # the scored hidden states' copy is made by the caller (add_fused_lm_head), before the function measured here
    counted = sum(parts.values()) - parts["scored hidden states"]
    # left out by the model: the per-token fp32 statistics (log-sum-exp, entropy, ...), and the CPU's fold temporaries
    # (a few fp32 tiles), which make the peak only where the gradients are not copied at the end (fp32)
    left_out = tokens * 4 * 12 + 8 * TILE[0] * TILE[1] * 4
    assert counted <= measured <= counted + left_out, (measured, counted, parts)
