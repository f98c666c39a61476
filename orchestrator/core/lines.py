"""Whole lines on a shared pipe.

A node's ranks write to one pipe (the node launcher prefixes and relays its lines). Under PYTHONUNBUFFERED=1, which
the launchers set so that output is never held back, stdout and stderr write through: `print` issues two writes, the
text and then the newline, and another rank's line lands between them (measured: 3,482 of 10,000 lines of two
processes broken; a rank's `[orch] resumed ...` glued to the end of the other rank's line). Line buffering without
write-through keeps output as prompt (a flush at every newline) and makes each line one write, which a pipe keeps
whole (writes up to PIPE_BUF, 4 KiB, are atomic).
"""

from __future__ import annotations

import sys


def whole_lines() -> None:
    """Make this process's stdout and stderr write each line in one write (call it first thing)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)
