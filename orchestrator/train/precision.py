"""What precision really ran, read from the training process, never from a config (`bf16: true` says nothing of the
weights the optimizer updates; accelerate 1.13-1.14 upcast FSDP2's to fp32 in its log line only, issue #3979).

- compute: the dtype a Linear layer of the model returned at the first forward of training: autocast (DDP),
  FSDP2's mixed-precision policy, DeepSpeed's casts and a 4-bit layer's compute dtype all end there;
- updated: the dtypes of the tensors the innermost optimizer steps (accelerate's and DeepSpeed's wrappers unwrapped):
  the model's own parameters under DDP, the fp32 upcast ones under FSDP2, DeepSpeed's fp32 partitions.
"""

from __future__ import annotations

import torch


class Probe:
    """A forward hook on the model's first Linear layer, removed once it has seen an output."""

    def __init__(self, model) -> None:
        self.compute: torch.dtype | None = None
        self.quantized = linear4bit(model) > 0  # QLoRA, whose LoRA adapter TRL's trainers cast to bf16
        linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
        self._hook = linear.register_forward_hook(self._seen) if linear is not None else None

    def _seen(self, module, inputs, output) -> None:
        if torch.is_tensor(output) and self.compute is None:
            self.compute = output.dtype
            self._hook.remove()

    def facts(self, optimizer) -> dict:
        compute = _name(self.compute) if self.compute else None
        return {"compute": compute, "updated": updated(optimizer), "quantized": self.quantized}


def linear4bit(model) -> int:
    """bitsandbytes' own 4-bit linear layers (QLoRA's base), not PEFT's LoRA wrapper of one (a class of the same
    name)."""
    return sum(type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
               for m in model.modules())  # fmt: skip


def updated(optimizer) -> list[str]:
    """The dtypes of what the innermost optimizer updates: its parameter groups' tensors and those it holds state for
    (DeepSpeed's ZeRO-3 puts a partition in its groups only for the length of its step)."""
    seen: set[int] = set()
    while getattr(optimizer, "optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    tensors = [p for group in getattr(optimizer, "param_groups", None) or [] for p in group["params"]]
    tensors += list(getattr(optimizer, "state", None) or {})
    return sorted({_name(t.dtype) for t in tensors if torch.is_tensor(t)})


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
