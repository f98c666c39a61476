"""The one exception users see: a one-line message that says what is wrong and how to fix it."""

from __future__ import annotations


class OrchError(Exception):
    """A user-facing error. The CLI prints `orch: error: <message>` and exits with code 2."""

    exit_code = 2


EXIT_RETRYABLE = 75  # EX_TEMPFAIL: a failure a rerun may not hit (a hang, a lost node, a network or NCCL error);
# managed jobs recover on it (job_recovery.recover_on_exit_codes)


class RetryableError(OrchError):
    """A node-side failure of the cluster, not of the input: one line, exit code 75."""

    exit_code = EXIT_RETRYABLE


def closest(word: str, choices, cutoff: float = 0.5) -> str | None:
    """The choice nearest to a mistyped word, for "did you mean X?" (None when nothing is close)."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return match[0] if match else None


def did_you_mean(word: str, choices, cutoff: float = 0.5) -> str:
    """`did you mean X? ` for the choice nearest to a mistyped word, or "" when nothing is close."""
    close = closest(word, choices, cutoff)
    return f"did you mean {close}? " if close else ""
