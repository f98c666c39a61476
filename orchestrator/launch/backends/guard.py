"""The keeper of one emulated node's processes: `python -m orchestrator.launch.backends.guard FD -- CMD...`.

orch starts one guard per node, in a session of its own, and keeps the write end of a pipe whose read end (FD) the
guard holds. Three kernel mechanisms make sure nothing of the node outlives orch, however orch ends:
  - the pipe: when orch exits for any reason, SIGKILL included, the kernel closes its end and the guard reads EOF;
  - a child subreaper (prctl PR_SET_CHILD_SUBREAPER): torchrun starts every rank in a session of its own, so a
    process-group signal misses them, but an orphaned rank is re-parented to the guard, never to init, so the
    guard's process tree is the node's whole set of processes;
  - the run lock (an flock orch opened and passed here): held while the guard lives, so a second launch of the
    same run is refused until every node is gone.
On EOF, on SIGTERM/SIGINT/SIGHUP, and after CMD exits, the guard ends its whole tree (SIGTERM, then SIGKILL after
ORCH_STOP_GRACE seconds) and exits with CMD's code (128 + signal when it was stopped).

Standard library and orch's env-knob parser only: it starts in ~30 ms and never imports the training stack.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from orchestrator.core.knobs import knob
from orchestrator.node.procs import DEFAULT_GRACE, end_tree, reap, subreaper


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m orchestrator.launch.backends.guard FD -- CMD [ARGS...]", file=sys.stderr)
        return 2
    watch, cmd = int(argv[0]), argv[2:]
    grace = knob(os.environ, "ORCH_STOP_GRACE", DEFAULT_GRACE)  # parsed (and refused) on the launch side first
    subreaper()
    stopped: list[int] = []

    def on_signal(signum, _frame):
        stopped.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(cmd)  # same process group as the guard; the run lock's fd is not passed on
    while child.poll() is None and not stopped:
        try:
            ready, _, _ = select.select([watch], [], [], 0.5)
        except InterruptedError:
            continue
        if ready and not os.read(watch, 1):  # EOF: orch is gone
            try:  # orch read our output: with it gone the pipe is broken, and the message may go nowhere
                print("[orch] orch exited: stopping this node's processes", file=sys.stderr, flush=True)
            except OSError:
                pass
            stopped.append(signal.SIGHUP)
    end_tree(grace, child)
    child.wait()
    reap()
    if stopped and child.returncode in (0, None):
        return 128 + stopped[0]
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
