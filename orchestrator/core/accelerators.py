"""`--gpus` values and the accelerators orch knows (SkyPilot's parser accepts any name offline, e.g. Z999:8)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.errors import OrchError, did_you_mean

# Name as SkyPilot spells it -> memory per device in GiB.
KNOWN_GIB = {
    "B200": 180,
    "H200": 141,
    "H100": 80,
    "H100-MEGA": 80,
    "GH200": 96,
    "A100-80GB": 80,
    "A100": 40,
    "L40S": 48,
    "L40": 48,
    "A6000": 48,
    "L4": 24,
    "A10G": 24,
    "A10": 24,
    "V100-32GB": 32,
    "V100": 16,
    "T4": 16,
    "MI300X": 192,
}
CPU = "CPU"

# Name as SkyPilot spells it -> CUDA compute capability (NVIDIA's "CUDA GPUs - Compute Capability" table), for what a
# kernel build declares it runs on (launch/kernelcheck.py). AMD parts (MI300X) have none.
CUDA_CAPABILITY = {
    "B200": (10, 0),
    "H200": (9, 0),
    "H100": (9, 0),
    "H100-MEGA": (9, 0),
    "GH200": (9, 0),
    "A100-80GB": (8, 0),
    "A100": (8, 0),
    "L40S": (8, 9),
    "L40": (8, 9),
    "A6000": (8, 6),
    "L4": (8, 9),
    "A10G": (8, 6),
    "A10": (8, 6),
    "V100-32GB": (7, 0),
    "V100": (7, 0),
    "T4": (7, 5),
}

# Peak dense BF16 tensor throughput per device, TFLOPS, for MFU (orchestrator/train/throughput.py): the vendors'
# datasheets, which print "with sparsity" figures for NVIDIA parts; dense is half of those. Matched against
# torch.cuda.get_device_name(), most specific first. Parts without a published BF16 figure (A10G, V100, T4) are
# left out: MFU is then not shown, with the reason.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),  # NVIDIA H100 datasheet: BF16 1,513 TFLOPS with sparsity (PCIe)
    ("H100 NVL", 835.0),  # NVIDIA H100 datasheet: BF16 1,671 TFLOPS with sparsity (NVL)
    ("H100", 989.4),  # NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity (SXM)
    ("H200", 989.4),  # NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity (SXM)
    ("GH200", 989.4),  # NVIDIA GH200 datasheet: BF16 1,979 TFLOPS with sparsity
    ("A100", 312.0),  # NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity)
    ("L40S", 362.05),  # NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity (362.05 dense)
    ("L4", 121.0),  # NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity
    ("A10", 125.0),  # NVIDIA A10 datasheet: BF16 125 TFLOPS dense (250 with sparsity); not the A10G
    ("MI300X", 1307.4),  # AMD Instinct MI300X datasheet: BF16 1307.4 TFLOPS dense
)


def peak_tflops(device_name: str) -> float | None:
    """Peak dense BF16 TFLOPS of a device, from its name as torch reports it (None when orch has no figure)."""
    name = device_name.upper()
    if "A10G" in name:
        return None
    for part, tflops in PEAK_BF16_TFLOPS:
        if part.upper() in name:
            return tflops
    return None


@dataclass(frozen=True)
class Gpus:
    name: str | None
    """Accelerator name (as SkyPilot spells it, or CPU for local processes); None when only a count was given
    (`--gpus 4`: keep the recipe's type)."""
    count: int
    """Devices per node."""

    def __str__(self) -> str:
        """`A100:8`, the form SkyPilot's `resources.accelerators` takes."""
        return f"{self.name}:{self.count}" if self.name else str(self.count)

    def over(self, recipe: Gpus | None) -> Gpus:
        """This flag's value over the recipe's: a count alone keeps the recipe's accelerator type."""
        return self if self.name or recipe is None else Gpus(recipe.name, self.count)


def memory_gib(name: str) -> int:
    return KNOWN_GIB[canonical(name)]


def canonical(name: str) -> str:
    for known in (*KNOWN_GIB, CPU):
        if known.lower() == name.lower():
            return known
    hint = did_you_mean(name.upper(), KNOWN_GIB)
    raise OrchError(f"unknown accelerator {name!r}; {hint}known: {', '.join(KNOWN_GIB)}")


def from_resources(value) -> Gpus | None:
    """A task's `resources.accelerators` (`A100:8` or `{A100: 8}`), or None when it names none."""
    if value is None:
        return None
    if isinstance(value, (list, tuple, set)) and len(value) == 1:
        (value,) = value
    if isinstance(value, (dict, list, tuple, set)) and len(value) != 1:  # SkyPilot's candidates: any of them, in order
        raise OrchError(f"resources.accelerators {value!r}: orch plans one accelerator type (processes per node, the "
                        "global batch, the memory check): name one, for example A100:8, and pass another with "
                        "--gpus")  # fmt: skip
    if isinstance(value, dict):
        ((name, count),) = value.items()
        value = f"{name}:{count}"
    return parse(str(value), "resources.accelerators")


def parse(value: str, flag: str = "--gpus") -> Gpus:
    """`A100:8`, `A100` (1 device), `8` (count only), `CPU:2` (CPU processes per node), `none` (CPU nodes: one process
    each, as SkyPilot's `--gpus none`)."""
    text = value.strip()
    if text.lower() == "none":
        return Gpus(CPU, 1)
    name: str | None
    name, sep, count_text = text.rpartition(":")
    if not sep:
        name, count_text = (None, text) if text.isdigit() or text.lstrip("-").isdigit() else (text, "1")
    if name is not None and not name:
        raise OrchError(f"{flag} {value!r}: missing accelerator name before ':' (for example A100:8)")
    try:
        count = int(count_text)
    except ValueError:
        raise OrchError(
            f"{flag} {value!r}: the count {count_text!r} is not a whole number (for example A100:8)"
        ) from None
    if count < 1:
        raise OrchError(f"{flag} {value!r}: the GPU count must be a positive integer (for example A100:8)")
    return Gpus(canonical(name) if name else None, count)
