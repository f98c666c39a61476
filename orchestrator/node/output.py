"""What a node's output says: the first real error a rank raised, not the launchers' summaries after it. Read by the
node launcher (node/supervise.py) and by the local backend over every emulated node's output."""

from __future__ import annotations

import re

# `ValueError: ...`, `torch.OutOfMemoryError: ...`, `[rank1]: RuntimeError: ...`, `orch: error: ...`
ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)|orch: error): .*\S)")
# what the launchers say after a rank failed: they quote nothing the user can act on
SUMMARIES = ("ChildFailedError", "CalledProcessError", "SignalException", "DistBackendError: [", "orch: error: node")
MAX_ERROR_LINES = 50
# A rank's first error that says the cluster failed, not the recipe: the node exits 75 (retryable), and a managed job
# recovers (job_recovery.recover_on_exit_codes). NCCL's and c10d's network failures, and a lost peer.
RETRYABLE = re.compile(
    r"NCCL (?:error|WARN)|nccl(?:System|Remote|Internal)Error|NCCL communicator was aborted|"
    r"Watchdog caught collective operation timeout|DistNetworkError|DistStoreError|"
    r"Connection (?:reset|closed) by peer|Broken pipe|ECONNRESET|No route to host|"
    r"CUDA error: (?:an illegal memory access|uncorrectable ECC error|unspecified launch failure)|"
    r"CUDA-capable device\(s\) is/are busy or unavailable"
)


def retryable(error: str) -> bool:
    """Whether a node's first error is the cluster's failure (a rerun on another node may not hit it)."""
    return bool(error) and bool(RETRYABLE.search(error))


def first_error(lines: list[str]) -> str:
    """The first error a rank raised, from a node's output: launchers' summaries skipped."""
    for line in lines:
        if not any(summary in line for summary in SUMMARIES):
            return line
    return lines[0] if lines else ""


def error_of(line: str) -> str:
    match = ERROR.match(line.strip())
    return match.group(1)[:500] if match else ""


# C0 controls and DEL, but tab, newline, carriage return (progress bars) and ESC (colours): a tiny model's random
# tokens, or a binary file printed by mistake, must not put raw bytes in the log. Undecodable bytes are already
# U+FFFD (the pipes are read with errors="replace").
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F]}


def printable(line: str) -> str:
    return line.translate(_CONTROLS)
