"""What a node's output says: the first real error a rank raised, not the launchers' summaries after it. Read by the
node launcher (node/supervise.py) and by the local backend over every emulated node's output."""

from __future__ import annotations

import re

# A traceback's last line, `ValueError: ...`, `torch.OutOfMemoryError: ...`, `[rank1]: RuntimeError: ...`, and a
# class of another package whatever its name ends with, which Python prints with its module (`huggingface_hub.errors.
# OfflineModeIsEnabled: ...`, `pyarrow.lib.ArrowInvalid: ...`, `requests.exceptions.ReadTimeout: ...`,
# `triton.runtime.errors.OutOfResources: ...`); argparse's `<prog>: error: ...` (TRL's parser on a rank); and orch's
# own `orch: error: ...`
ERROR = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\.[A-Z]\w*|"
    r"KeyboardInterrupt|StopIteration|[\w.-]+: error): .*\S)"
)
# what the launchers say after a rank failed: they quote nothing the user can act on
SUMMARIES = ("ChildFailedError", "CalledProcessError", "SignalException", "DistBackendError: [", "orch: error: node")
MAX_ERROR_LINES = 50


# Third-party notices a user can do nothing about, each matched as a whole line: the node's relay hides them, says
# how many it hid, and prints them after all when the training fails (ORCH_SHOW_NOTICES=on shows them as they come).
# (pattern, on CPU runs only)
NOTICES: tuple[tuple[re.Pattern[str], bool], ...] = (
    # bitsandbytes 0.50 on an x86 CPU with AVX512-BF16 (GPU hosts have them too) fetches a CPU 4-bit kernel from the
    # Kernels Hub as it is imported; without the `kernels` package, or offline without that kernel in the cache, its own
    # CPU kernel is used instead, and only CPU 4-bit inference would have used the other one
    (re.compile(r"Failed to load CPU gemm_4bit_forward from kernels-community: .*\. Please make sure you already "
                r"`pip install kernels` and the kernels >= 0\.11\.1"), False),
    # the kernels package with HF_HUB_OFFLINE=1 (smoke runs, nodes with no route to the Hub): the kernel was vetted when
    # it was downloaded (for a recipe's attention kernel, by the node's setup: train/attention_kernel.py)
    (re.compile(r"\S+\.py:\d+: UserWarning: Skipping publisher trust check for '[^']+' because Hugging Face Hub is in "
                r"offline mode\."), False),
    # DeepSpeed, imported by transformers, finds no GPU: every CPU run. On a GPU node it is a real problem: shown there
    (re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[WARNING\] \[real_accelerator\.py:\d+:get_accelerator\] "
                r"Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\."),
     True),
    # transformers' checkpoint rotation where two checkpoints have the same mtime: it sorts by step, which is right
    (re.compile(r"\[transformers\] mtime may not be reliable on this filesystem, falling back to numerical ordering"),
     False),
    # torchrun's exit barrier race (pytorch/pytorch#69520): the head node's agent closes the rendezvous store while
    # another node's agent still waits in the barrier, after every rank has finished; that agent logs it and exits 0
    (re.compile(r"\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] recvValueWithTimeout failed on SocketImpl\(.*\): "
                r"Failed to recv, got 0 bytes\. Connection was likely closed\. Did the remote server shutdown or "
                r"crash\?"),
     False),
    (re.compile(r"E\d{4} [\d:.]+ \d+ torch/distributed/elastic/agent/server/api\.py:\d+\] Error waiting on exit "
                r"barrier\. Elapsed: [\d.]+ seconds"), False),
    # c10d on a network without reverse DNS for the nodes (seen on the Slurm bed: SkyPilot's Slurm nodes): cosmetic
    (re.compile(r"\[W\d{4} [\d:.]+ socket\.cpp:\d+\] \[c10d\] The hostname of the client socket cannot be "
                r"retrieved\. err=-?\d+"), False),
)  # fmt: skip
# The rest of a notice's block: hidden only right after a hidden line (a C++ trace, the logger's traceback lines).
CONTINUED = re.compile(
    r"gemm_4bit_forward_kernel = get_kernel\(|return get_kernel_hub\(|"  # the source line Python's warning quotes
    r"Exception raised from recvBytes at \S+ \(most recent call first\):|frame #\d+: .*|<omitting python frames>|"
    r"E\d{4} [\d:.]+ \d+ torch/distributed/elastic/agent/server/api\.py:\d+\] .*|"  # and a blank line within
)


def notice(line: str, cpu: bool, continuing: bool = False) -> bool:
    """Whether a line of a node's output is one of NOTICES (for this device), or the rest of one (`continuing`: the
    line before was hidden)."""
    text = line.strip()
    if continuing and CONTINUED.fullmatch(text):
        return True
    return any((cpu or not cpu_only) and pattern.fullmatch(text) for pattern, cpu_only in NOTICES)


# Python's line between an exception and the one raised `from` it (`raise KeyError("... the metrics are ...") from
# exc`): the later one is the explanation its author wrote, the earlier one its bare cause (`KeyError: 'eval_bogus'`)
_CAUSED = re.compile(r"^(?:\[rank(\d+)\]:\s*)?The above exception was the direct cause of the following exception:$")
_RANK = re.compile(r"^\[rank(\d+)\]:")


class ErrorLines(list[str]):
    """A stream's error lines (error_of), the first MAX_ERROR_LINES, in order; an error raised `from` another takes
    its place, each rank's chain read apart (their lines interleave), unless it is a launcher's summary. Not an error
    that was raised while another was handled (`During handling of the above exception`): the first is the cause."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str | None, int] = {}  # by rank: the index of its last error
        self._caused: set[str | None] = set()  # ranks whose next error is raised from their last

    def feed(self, line: str) -> None:
        text = line.strip()
        if caused := _CAUSED.match(text):
            if caused.group(1) in self._last:
                self._caused.add(caused.group(1))
            return
        if not (error := error_of(text)):
            return
        rank = match.group(1) if (match := _RANK.match(text)) else None
        if rank in self._caused and not any(summary in error for summary in SUMMARIES):
            self[self._last[rank]] = error
        elif len(self) < MAX_ERROR_LINES:
            self._last[rank] = len(self)
            self.append(error)
        self._caused.discard(rank)


def first_error(lines: list[str]) -> str:
    """The first error a rank raised, from a node's output: launchers' summaries skipped."""
    for line in lines:
        if not any(summary in line for summary in SUMMARIES):
            return line
    return lines[0] if lines else ""


# A node's last line when its training failed (node/supervise.py writes it, launch/job_end.py reads it back from a
# cloud job's log): the node, accelerate's exit code, orch's own exit code when it differs, the first real error.
VERDICT = re.compile(
    r"^\[orch\] failed on node (?P<node>\d+): (?:a network or GPU failure \()?accelerate exited with code "
    r"(?P<code>\d+)(?:, orch exits (?P<exits>\d+), retryable\))?(?:: (?P<error>.*\S))?$"
)


STALLED = "orch: error: stalled on node "
"""The start of a node's line when its watchdog ended a stall (node/supervise.py; the node exits 75, retryable)."""


def verdict(node: int, code: int, error: str = "", exits: int | None = None) -> str:
    """The node's last line: `exits` (orch's exit code) is said only for a retryable failure, whose code differs."""
    said = f": {error}" if error else ""
    if exits is not None:
        return (f"[orch] failed on node {node}: a network or GPU failure (accelerate exited with code {code}, orch "
                f"exits {exits}, retryable){said}")  # fmt: skip
    return f"[orch] failed on node {node}: accelerate exited with code {code}{said}"


def error_of(line: str) -> str:
    match = ERROR.match(line.strip())
    return match.group(1)[:500] if match else ""


# C0 controls and DEL, but tab, newline, carriage return (progress bars) and ESC (colours): a tiny model's random
# tokens, or a binary file printed by mistake, must not put raw bytes in the log. Undecodable bytes are already
# U+FFFD (the pipes are read with errors="replace").
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x1B), *range(0x1C, 0x20), 0x7F]}


def printable(line: str) -> str:
    return line.translate(_CONTROLS)
