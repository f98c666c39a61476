"""A DataLoader worker that cannot send a batch ends, instead of leaving its rank waiting for that batch forever.

A worker hands each batch to a multiprocessing queue, whose feeder thread pickles it. When that fails (an object in the
batch that cannot be pickled, a tensor's file descriptor whose AF_UNIX socket path is too long), Python prints the
traceback and drops the batch (multiprocessing/queues.py `_on_queue_feeder_error`); the worker lives on, so torch's
checks of its workers find nothing wrong, and the rank waits without a step until orch's stall watchdog (30 minutes
before the first step). In a DataLoader worker orch's hook prints the same traceback and one line, then ends the
worker: torch's DataLoader raises in the rank at once ("DataLoader worker ... exited unexpectedly"), and the node
quotes the first error, the feeder's. Other queues of the process keep Python's behaviour.
"""

from __future__ import annotations

import multiprocessing.queues
import os
import sys
import traceback

_PYTHONS = multiprocessing.queues.Queue._on_queue_feeder_error


def _on_feeder_error(error: BaseException, obj: object) -> None:
    from torch.utils.data import get_worker_info

    worker = get_worker_info()
    if worker is None:  # not a DataLoader worker's queue
        _PYTHONS(error, obj)
        return
    traceback.print_exc()
    print(f"[orch] DataLoader worker {worker.id} (pid {os.getpid()}) could not send a batch to its rank "
          f"({type(error).__name__}); ending it, as its rank would wait for that batch forever", file=sys.stderr,
          flush=True)  # fmt: skip
    os._exit(1)


def install() -> None:
    """Before the trainer builds its DataLoader: the workers it forks inherit the hook."""
    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(_on_feeder_error)
