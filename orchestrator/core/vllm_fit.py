"""What a vLLM engine needs of a GPU beside TRL's trainer: a colocated engine's share of each training GPU (its reserve
at the step's peak, and the weights and one sequence's KV cache it refuses to start without), and the server node's
engines (`trl vllm-serve`). Checked by core/fit.py's GPU check and by the launch side for the server node."""

from __future__ import annotations

import math
from collections.abc import Mapping

from orchestrator.core import memory
from orchestrator.core.errors import OrchError

VLLM_WEIGHTS_ROOM = 1.5  # a lower vLLM share is proposed only where it holds vLLM's weights and half as much KV cache


def with_vllm(estimate: memory.Estimate, capacity_gib: float) -> float:
    """GiB one GPU of `capacity_gib` needs at the step's peak: the trainer's estimate plus a colocated vLLM engine's
    reserve (its share of the GPU's total); with sleep mode the engine holds it only while generating, beside the
    trainer's states and CUDA context, and frees it for the step."""
    setup = estimate.setup
    reserve = setup.vllm_share * capacity_gib
    if not setup.vllm_sleeps:
        return estimate.gib + reserve
    held = sum(memory.states(setup).values()) / memory.GIB + memory.CONTEXT_GIB
    return max(estimate.gib, held + reserve)


def vllm_words(setup: memory.Setup, capacity_gib: float) -> str:
    """`beside colocated vLLM's 14 GiB (vllm_gpu_memory_utilization 0.35)`, or nothing without one."""
    if not setup.vllm_share:
        return ""
    sleeping = "; vllm_enable_sleep_mode frees it while the trainer steps" if setup.vllm_sleeps else ""
    return (f" beside colocated vLLM's {setup.vllm_share * capacity_gib:.1f} GiB (vllm_gpu_memory_utilization "
            f"{setup.vllm_share:g}{sleeping})")  # fmt: skip


def vllm_kv_gib(arch: memory.Arch, tokens: int) -> float:
    """The KV cache vLLM needs for `tokens` of one sequence: K and V of every layer's KV heads, in 16 bits (vLLM's
    own figure for Qwen3-8B's 40960 positions: 5.62 GiB)."""
    return 2 * arch.layers * arch.kv_heads * arch.hd * 2 * tokens / memory.GIB


def check_vllm_room(setup: memory.Setup, capacity_gib: float, gpu: str) -> None:
    """A colocated vLLM engine starts only where its share of the GPU holds the weights and the KV cache of one
    sequence of its max_model_len (vLLM's "To serve at least one request with the model's max seq len (...)" at each
    rank's trainer construction, after the download); TRL leaves max_model_len to vLLM, which takes the model's
    positions (131072 for Llama 3.1: 16 GiB of KV cache). Refused only where weights and that cache alone exceed the
    share: vLLM's profiling run and CUDA graphs take more besides."""
    tokens = setup.vllm_max_len or setup.arch.positions
    if not setup.vllm_share or not tokens:
        return
    share = setup.vllm_share * capacity_gib
    weights = setup.arch.params * memory.DTYPE_BYTES.get(setup.weights_dtype, 2) / memory.GIB
    kv = vllm_kv_gib(setup.arch, tokens)
    if weights + kv <= share:
        return
    fixes = []
    generated = setup.seq_len  # the prompt and completion TRL asks for
    if generated < tokens and weights + vllm_kv_gib(setup.arch, generated) <= share:
        fixes.append(f"vllm_max_model_length={generated} (the prompt and completion TRL generates: "
                     f"{vllm_kv_gib(setup.arch, generated):.1f} GiB of KV cache)")  # fmt: skip
    needed = math.ceil((weights + kv) / capacity_gib * 20) / 20
    if needed < 1:
        fixes.append(f"vllm_gpu_memory_utilization={needed:g} if the trainer fits beside it")
    fixes.append("vLLM on a node of its own (vllm_mode=server with VLLM_SERVER_NODES=1)")
    given = "vllm_max_model_length" if setup.vllm_max_len else "its max_model_len (the model's positions)"
    raise OrchError(f"colocated vLLM cannot start: its share of each {gpu} (vllm_gpu_memory_utilization "
                    f"{setup.vllm_share:g}, {share:.1f} GiB) does not hold the weights ({weights:.1f} GiB) and the KV "
                    f"cache of one {tokens}-token sequence, {given} ({kv:.1f} GiB), which vLLM refuses to start "
                    "without; set " + ", or ".join(fixes))  # fmt: skip


VLLM_SERVE_SHARE = 0.9  # trl vllm-serve's gpu_memory_utilization (node/vllm.server_argv gives none)


def tensor_parallel(env: Mapping[str, str], gpus: int) -> int:
    """VLLM_TENSOR_PARALLEL_SIZE (default 1): the vLLM server node's tensor-parallel size, which must divide its `gpus`
    (its data-parallel size is the rest)."""
    raw = str(env.get("VLLM_TENSOR_PARALLEL_SIZE") or "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1 or gpus % int(raw):
        raise OrchError(f"VLLM_TENSOR_PARALLEL_SIZE={raw!r} must divide the {gpus} GPUs of the vLLM node")
    return int(raw)


def check_vllm_server(arch: memory.Arch, capacity_gib: float, gpu: str, gpus: int, tp: int) -> None:
    """The vLLM server node's engines (`trl vllm-serve`, tensor_parallel_size `tp` over its `gpus`) start only where
    0.9 of each GPU holds its part of the weights and of one model-length sequence's KV cache (vLLM splits the KV
    heads over the tensor-parallel ranks, each keeping one at least): else one line naming the tensor-parallel size
    that fits (VLLM_TENSOR_PARALLEL_SIZE)."""
    if not arch.positions:
        return
    share = VLLM_SERVE_SHARE * capacity_gib

    def parts(t: int) -> tuple[float, float]:  # (weights, KV cache) GiB on one GPU
        kv = vllm_kv_gib(arch, arch.positions) * max(1, arch.kv_heads // t) / arch.kv_heads
        return arch.params * 2 / t / memory.GIB, kv

    if sum(parts(tp)) <= share:
        return
    sizes = [t for t in range(tp + 1, gpus + 1) if gpus % t == 0 and arch.heads % t == 0 and sum(parts(t)) <= share]
    fix = "use a GPU with more memory"
    if sizes:
        fix = f"set --env VLLM_TENSOR_PARALLEL_SIZE={sizes[0]} (each GPU then holds {sum(parts(sizes[0])):.1f} GiB)"
    weights, kv = parts(tp)
    raise OrchError(f"the vLLM server node cannot start: trl vllm-serve takes {VLLM_SERVE_SHARE:g} of each {gpu} "
                    f"({share:.1f} GiB), which does not hold its part of the weights ({weights:.1f} GiB at "
                    f"tensor_parallel_size {tp}) and of the KV cache of one {arch.positions}-token sequence, the "
                    f"model's positions ({kv:.1f} GiB), which vLLM refuses to start without; {fix}")  # fmt: skip
