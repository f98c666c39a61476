"""The Kernels Hub attention kernel a recipe's ranks load (attn_implementation `org/name`, or flash_attention_2/3/4,
whose Kernels Hub fallback the nodes load: uv.lock installs no flash-attn package), checked before a cloud launch
(rehearsal/kernel.py does it in a process of its own, beside the data check): the repo and the version transformers asks
for exist, its publisher is one the Hub trusts (or the recipe allows all kernels), it has a build for the nodes' torch
and CUDA (uv.lock's) and CPU, and that build declares the accelerator's CUDA compute capability. One that no rank could
load stops the launch (exit 2, one line); a laptop without the kernels package or an answer from the Hub gets a note.
ORCH_KERNEL_CHECK=off skips it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from orchestrator.core import attention as attention_names
from orchestrator.core.accelerators import CUDA_CAPABILITY
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.launch.resolved import Launch

TIMEOUT_S = 120
GRACE_CPUS = ("GH200", "GB200", "GB300")
"""Accelerators whose hosts are aarch64 (NVIDIA Grace): their kernel builds are *-aarch64-linux."""


def locked(workdir: Path) -> tuple[str, str] | None:
    """(torch's major.minor, CUDA's major.minor) of the uv.lock the nodes install (node-setup.sh), or None where the
    recipe's workdir has no uv.lock with both. torch's CUDA is the cuda-toolkit its Linux wheel depends on. Read as
    uv writes each package (`[[package]]`, then its name and version lines): tomllib needs Python 3.11, orch 3.10."""
    try:
        text = (workdir / "uv.lock").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    found = []
    for name in ("torch", "cuda-toolkit"):
        m = re.search(rf'^\[\[package\]\]\nname = "{name}"\nversion = "(\d+)\.(\d+)[^"]*"$', text, re.M)
        if m is None:
            return None
        found.append(f"{m[1]}.{m[2]}")
    return found[0], found[1]


class Check:
    """The check's process, started before the data check and read after it; killed if the launch stops first."""

    def __init__(self, launch: Launch):
        self.proc: subprocess.Popen | None = None
        self.note: str | None = None
        if knob(os.environ, "ORCH_KERNEL_CHECK", "on") == "off":
            return
        attention, allow_all = attention_names.requested(launch.settings)
        if not attention_names.may_need_hub(attention):
            return
        versions = locked(launch.recipe.workdir)
        if versions is None:
            self.note = f"[orch] attention kernel {attention}: not checked (no uv.lock with torch in the workdir)"
            return
        accelerator = (launch.gpus.name if launch.gpus else None) or ""
        if accelerator.upper().startswith("MI"):  # AMD: a ROCm torch, not the lock's CUDA one
            self.note = f"[orch] attention kernel {attention}: not checked for {accelerator} (ROCm builds)"
            return
        capability = CUDA_CAPABILITY.get(accelerator.upper())  # its names are SkyPilot's, in capitals
        request = {"attention": attention, "allow_all": allow_all, "torch": versions[0], "cuda": versions[1],
                   "cpu": "aarch64" if accelerator.upper() in GRACE_CPUS else "x86_64",
                   "accelerator": accelerator.upper() if capability else None,
                   "capability": ".".join(map(str, capability)) if capability else None}  # fmt: skip
        self.attention = attention
        # the request in argv (names and versions, no secret): the process asks the Hub while the data check runs
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.rehearsal.kernel", json.dumps(request)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def __enter__(self) -> Check:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def result(self) -> str | None:
        """The line to print, or None where there is nothing to check; an OrchError where no rank could load it."""
        if self.proc is None:
            return self.note
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"[orch] attention kernel {self.attention}: not checked (no answer in {TIMEOUT_S} s)"
        line = next((x for x in out.splitlines() if x.startswith("ORCH_KERNEL ")), None)
        if line is None:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            return f"[orch] attention kernel {self.attention}: not checked (the check failed: {tail[:200]})"
        result = json.loads(line.split(" ", 1)[1])
        if result.get("fatal"):
            raise OrchError(result["fatal"])
        said = result.get("line") or result.get("note")
        return f"[orch] {said}" if said else None
