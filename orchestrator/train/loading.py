"""What loading the trained model costs each rank in host memory, read from the process.

`HostMemory` reads the process's resident set and its peak (Linux's VmRSS/VmHWM; writing 5 to /proc/self/clear_refs
resets the peak) around each phase; `trained_model()` brackets the trained model's `from_pretrained` with its marks.
The figures go to the rank's report (`host_memory` in rank<R>.json) and are checked against the memory model's
(core/memory.at_load) in tests/test_load_memory.py.

Not done here yet: building the model on the meta device on ranks that receive their weights by FSDP2's broadcast.
Tried and reverted: accelerate's `_prepare_fsdp2` maps the optimizer's parameters to the sharded ones by `data_ptr()`,
which is 0 for every meta tensor, so every optimizer entry of such a rank collapsed onto one parameter (training
silently wrong there; the next checkpoint's `get_optimizer_state_dict` failed with `KeyError: 15`).
"""

from __future__ import annotations

import contextlib
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
        """Close `phase`: its peak and the resident set now; the next phase's peak starts here."""
        self.phases[phase] = {"peak": self._field("VmHWM"), "after": self.rss()}
        self._reset_peak()

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
