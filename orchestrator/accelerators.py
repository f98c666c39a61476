"""`--gpus` values and the accelerators orch knows (SkyPilot's parser accepts any name offline, e.g. Z999:8)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import OrchError, closest

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


@dataclass(frozen=True)
class Gpus:
    name: str | None
    """Accelerator name, or None when only a count was given (`--gpus 4`: keep the recipe's type)."""
    count: int
    """Devices per node."""

    def spec(self, fallback_name: str | None) -> str:
        return f"{self.name or fallback_name}:{self.count}"


def memory_gib(name: str) -> int:
    return KNOWN_GIB[canonical(name)]


def canonical(name: str) -> str:
    for known in (*KNOWN_GIB, CPU):
        if known.lower() == name.lower():
            return known
    close = closest(name.upper(), KNOWN_GIB)
    hint = f"did you mean {close}? " if close else ""
    raise OrchError(f"unknown accelerator {name!r}; {hint}known: {', '.join(KNOWN_GIB)}")


def parse(value: str) -> Gpus:
    """`A100:8`, `A100` (1 device), `8` (count only), `CPU:2` (local processes per node)."""
    text = value.strip()
    name, sep, count_text = text.rpartition(":")
    if not sep:
        name, count_text = (None, text) if text.isdigit() or text.lstrip("-").isdigit() else (text, "1")
    if name is not None and not name:
        raise OrchError(f"--gpus {value!r}: missing accelerator name before ':' (for example A100:8)")
    try:
        count = int(count_text)
    except ValueError:
        raise OrchError(
            f"--gpus {value!r}: the count {count_text!r} is not a whole number (for example A100:8)"
        ) from None
    if count < 1:
        raise OrchError(f"--gpus {value!r}: the GPU count must be a positive integer (for example A100:8)")
    return Gpus(canonical(name) if name else None, count)
