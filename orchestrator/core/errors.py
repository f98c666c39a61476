"""The one exception users see: a one-line message that says what is wrong and how to fix it."""

from __future__ import annotations

import re


class OrchError(Exception):
    """A user-facing error. The CLI prints `orch: error: <message>` and exits with code 2."""

    exit_code = 2


EXIT_RETRYABLE = 75  # EX_TEMPFAIL: a failure a rerun may not hit (a hang, a lost node, a network or NCCL error);
# managed jobs recover on it (job_recovery.recover_on_exit_codes)


# A rank's first error that says the cluster failed, not the recipe: the node exits 75 (retryable), and a managed job
# recovers (job_recovery.recover_on_exit_codes). NCCL's and c10d's network failures, and a lost peer. Read from a node's
# output (node/supervise.py, launch/job_end.py) and by a rank that raised (train/entry.run).
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


class DoesNotFit(OrchError):
    """A memory refusal before launch whose first fix is a smaller per-device batch that keeps the run's math
    (core/fit.check_gpu, core/batch.smaller): `overrides` are its settings, which `orch run --auto-fit` applies by
    itself."""

    def __init__(self, message: str, overrides: dict[str, str], fits: str) -> None:
        super().__init__(message)
        self.overrides = overrides
        self.fits = fits  # what the fix needs and keeps, in words


class RetryableError(OrchError):
    """A node-side failure of the cluster, not of the input: one line, exit code 75."""

    exit_code = EXIT_RETRYABLE


class NotRetried(OrchError):
    """A retryable failure that came back too often to be retried again (node/retries.py): one line, exit code 1."""

    exit_code = 1


def closest(word: str, choices, cutoff: float = 0.5) -> str | None:
    """The choice nearest to a mistyped word, for "did you mean X?" (None when nothing is close)."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return match[0] if match else None


def did_you_mean(word: str, choices, cutoff: float = 0.5, begins: bool = False) -> str:
    """`did you mean X? ` for the choice nearest to a mistyped word, or "" when nothing is close. With `begins`, the
    first choice (in their order) that begins with the word comes first: a value cut short (optim=adamw: adamw_torch,
    SHARDED: SHARDED_STATE_DICT), which spelling alone matched to another or to none."""
    started = next((c for c in choices if word and str(c).startswith(word)), None) if begins else None
    close = started or closest(word, choices, cutoff)
    return f"did you mean {close}? " if close else ""
