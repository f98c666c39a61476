"""The one exception users see: a one-line message that says what is wrong and how to fix it."""


class OrchError(Exception):
    """A user-facing error. The CLI prints `orch: error: <message>` and exits with code 2."""

    exit_code = 2
