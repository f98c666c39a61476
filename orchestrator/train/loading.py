"""What loading the trained model costs each rank in host memory, read from the process, and the ranks that receive
their weights by broadcast built in memory that is never written.

`HostMemory` reads the process's resident set and its peak (Linux's VmRSS/VmHWM; writing 5 to /proc/self/clear_refs
resets the peak) around each phase; `trained_model()` brackets the trained model's `from_pretrained` with its marks.
The figures go to the rank's report (`host_memory` in rank<R>.json) and are checked against the memory model's
(core/load_memory.at_load) in tests/test_load_memory.py.

`install()`: under FSDP2 with CPU-RAM-efficient loading only global rank 0's weights matter (accelerate's
`fsdp2_load_full_state_dict` broadcasts them), yet transformers 5 fills every parameter of the other local ranks with
`zeros_like` on CPU and accelerate then upcasts the trained ones to fp32: a whole model per rank (263 GiB per rank for
70B). Those ranks now get views of one `torch.empty` allocation instead, first in the load dtype, then, just before
accelerate's upcast, in fp32: the pages are never written, so the kernel never makes them resident. Not the meta
device: accelerate's `_prepare_fsdp2` maps optimizer parameters to their sharded ones by `data_ptr()`, which is 0 for
every meta tensor (tried: every optimizer entry of such a rank collapsed onto one parameter, then `KeyError: 15` at
the next checkpoint); views at distinct offsets keep distinct, real data pointers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


class HostMemory:
    """Resident-set figures in bytes, per phase: `phases[name] = {"peak": ..., "after": ...}` since the last mark."""

    def __init__(self) -> None:
        self.baseline = self.rss()
        self.phases: dict[str, dict[str, int]] = {}
        self.peak_resets = self._reset_peak()

    @staticmethod
    def _field(name: str) -> int:
        try:
            match = re.search(rf"^{name}:\s+(\d+) kB", STATUS.read_text(), re.M)
        except OSError:
            return 0
        return int(match.group(1)) * 1024 if match else 0

    def rss(self) -> int:
        return self._field("VmRSS")

    @staticmethod
    def _reset_peak() -> bool:
        try:
            CLEAR_REFS.write_text("5")
            return True
        except OSError:  # not Linux, or not allowed: the peak is then the process's lifetime peak
            return False

    def mark(self, phase: str) -> None:
        """Close `phase`: its peak and the resident set now; the next phase's peak starts here. Where the process
        uses CUDA, also its GPU's peak (torch's caching allocator, `gpu_peak`), which `make gpu-check` compares with
        the memory model's per-GPU figure at load."""
        self.phases[phase] = {"peak": self._field("VmHWM"), "after": self.rss(), **self._gpu_peak()}
        self._reset_peak()

    @staticmethod
    def _gpu_peak() -> dict[str, int]:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # CPU, or nothing on the GPU yet
            return {}
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return {"gpu_peak": peak}

    def report(self) -> dict:
        return {"baseline": self.baseline, "peak_resets": self.peak_resets, **self.phases}


@contextlib.contextmanager
def trained_model(model_id: str, memory: HostMemory | None = None):
    """While TRL builds the trainer, the first `from_pretrained(model_id)` (the trained model; TRL's auto classes end
    there too) is bracketed by `memory` marks: "before_load" and "load"."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    seen = []

    def from_pretrained(cls, name, *args, **kwargs):
        if seen or memory is None or str(name) != str(model_id):
            return original.__func__(cls, name, *args, **kwargs)
        seen.append(name)
        memory.mark("before_load")
        model = original.__func__(cls, name, *args, **kwargs)
        memory.mark("load")
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


# ---------------------------------------------------------------- ranks that receive their weights by broadcast

_INSTALLED = "_orch_untouched"
ALIGN = 64  # bytes between views: every dtype's alignment
MMAP_ALWAYS = 32 * 2**20  # glibc maps any block this large fresh from the kernel (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


def untouched(shapes: dict[str, tuple[tuple[int, ...], object]]) -> dict:
    """One view per name (shape, dtype) of a single `torch.empty` allocation, at distinct aligned offsets. Nothing
    writes the allocation, so its pages stay unbacked until the broadcast's values replace these tensors, and read as
    zeros like transformers' fill: a block glibc takes from the kernel is zero pages; a smaller one, which may reuse
    the heap, is zeroed (at most 32 MiB)."""
    import torch

    spans, size = {}, 0  # name -> (offset, bytes) in the one allocation
    for name, (shape, dtype) in shapes.items():
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        spans[name] = (size, nbytes)
        size += -(-max(1, nbytes) // ALIGN) * ALIGN
    block = torch.empty(size, dtype=torch.uint8)
    if size < MMAP_ALWAYS:
        block.zero_()
    return {name: block[start : start + nbytes].view(shapes[name][1]).view(shapes[name][0])
            for name, (start, nbytes) in spans.items()}  # fmt: skip


def fsdp2_receiver() -> bool:
    """transformers' own test for a rank that skips the checkpoint (FSDP with CPU-RAM-efficient loading, distributed,
    not local rank 0), narrowed to FSDP2, whose prepare broadcasts every value from rank 0."""
    from transformers.modeling_utils import is_fsdp_enabled, is_local_dist_rank_0

    return os.environ.get("FSDP_VERSION", "1") == "2" and is_fsdp_enabled() and not is_local_dist_rank_0()


def install() -> None:
    """Wrap transformers' fill of a receiving rank's parameters and accelerate's FSDP2 preparation (see the module's
    docstring); every other path runs the owners' code unchanged."""
    import accelerate.accelerator
    import torch
    from torch.distributed.fsdp import FSDPModule
    from transformers import modeling_utils
    from transformers.modeling_utils import PreTrainedModel

    move = PreTrainedModel._move_missing_keys_from_meta_to_device
    if getattr(move, _INSTALLED, False):
        return

    @functools.wraps(move)
    def move_missing(self, missing_keys, device_map, device_mesh, hf_quantizer):
        if hf_quantizer is not None or not fsdp2_receiver():
            return move(self, missing_keys, device_map, device_mesh, hf_quantizer)
        views = untouched({name: (p.shape, p.dtype) for name, p in self.named_parameters()})
        for name, view in views.items():  # instead of transformers' zeros_like, one per parameter
            modeling_utils._load_parameter_into_model(self, name, view)
        for name, buffer in self.named_buffers():  # small; as transformers does
            modeling_utils._load_parameter_into_model(self, name, torch.zeros_like(buffer, device="cpu"))

    prepare = accelerate.accelerator.fsdp2_prepare_model

    @functools.wraps(prepare)
    def fsdp2_prepare_model(accelerator, model):
        plugin = accelerator.state.fsdp_plugin
        params = dict(model.named_parameters())
        if (not accelerator.is_main_process and plugin.cpu_ram_efficient_loading
                and accelerator.mixed_precision != "no" and not isinstance(model, FSDPModule)
                and not any(type(p).__name__ == "Params4bit" for p in params.values())):  # fmt: skip
            upcast = {n: p for n, p in params.items() if p.requires_grad and p.dtype != torch.float32}
            views = untouched({n: (p.shape, torch.float32) for n, p in upcast.items()})
            for name, p in upcast.items():  # what accelerate's upcast would allocate and write, unwritten
                p.data = views[name]
        return prepare(accelerator, model)

    setattr(move_missing, _INSTALLED, True)
    PreTrainedModel._move_missing_keys_from_meta_to_device = move_missing
    accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model
