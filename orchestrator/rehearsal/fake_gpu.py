"""The GPU a rehearsal pretends to have (orchestrator/rehearsal/role.py): CUDA reported present with the node's GPU
count, the launch's compute capability where the owners' checks read one, and DeepSpeed's dtype checks answered as
its CUDA accelerator answers them. Nothing here runs a kernel."""

from __future__ import annotations


def cuda(devices: int) -> None:
    """CUDA reported present, as on the node: enough for accelerate and transformers to take the GPU path.

    Nothing runs a kernel: the trainer is built, never trained, and a module moved to a CUDA device stays where
    it is (the trainer, accelerate's prepare_model for a reference model, ...); dtype changes still apply; a tensor
    pinned stays as it is.
    """
    import torch

    original_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cuda":
            return self if dtype is None else original_to(self, dtype=dtype)
        return original_to(self, *args, **kwargs)

    torch.nn.Module.to = to
    torch.nn.Module.cuda = lambda self, device=None: self
    # pinned host memory needs the accelerator's driver (a CPU build: "Cannot access accelerator device when none is
    # available"): FSDP2's CPUOffloadPolicy pins each sharded parameter as a DPO reference model is prepared
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: devices
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.get_device_name = lambda *a, **k: "rehearsal"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # each role sets its launch's (capability)


def capability(capability: tuple[int, int]) -> None:
    """The launch's GPU as the owners' checks read it: its compute capability, and TF32 where it is >= 8.0 (transformers
    asks torch.version.cuda and the device's properties, None and absent on a CPU build: `tf32=true` was refused for
    an A100 as for a T4)."""
    import torch
    from transformers import training_args

    torch.cuda.get_device_capability = lambda *a, **k: capability
    training_args.is_torch_tf32_available = lambda: capability[0] >= 8


def deepspeed_dtypes() -> None:
    """DeepSpeed's engine asks its accelerator whether fp16 and bf16 run (`_do_sanity_check`); the rehearsal's is the
    CPU one (DS_ACCELERATOR=cpu), which refused fp16 for every GPU ("Type fp16 is not supported on your device"). Its
    CUDA accelerator's own code answers instead, on the launch's GPU: fp16 from compute capability 7.0."""
    from deepspeed.accelerator import cuda_accelerator, get_accelerator

    accelerator = get_accelerator()
    for name in ("is_fp16_supported", "is_bf16_supported"):
        setattr(accelerator, name, getattr(cuda_accelerator.CUDA_Accelerator, name).__get__(accelerator))
