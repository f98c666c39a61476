"""A DataLoader worker that cannot send a batch hands its rank the error, instead of leaving it waiting forever.

A worker hands each batch to a multiprocessing queue, whose feeder thread pickles it. When that fails (an object in the
batch that cannot be pickled, a tensor's file descriptor whose AF_UNIX socket path is too long), Python prints the
traceback and drops the batch (multiprocessing/queues.py `_on_queue_feeder_error`); the worker lives on, so torch's
checks of its workers find nothing wrong, and the rank waits without a step until orch's stall watchdog (30 minutes
before the first step). In a DataLoader worker orch's hook prints the same traceback and one line, then sends the rank,
in that batch's place, the error as torch's own DataLoader sends a worker's exception (`(index, ExceptionWrapper)`):
the rank raises it at once (`AttributeError: Caught AttributeError in DataLoader worker process 0.`), and the node
quotes the first error, the feeder's. The worker stays alive until the rank's DataLoader shuts it down, so the batches
it sent before, whose tensors the rank fetches from it, still arrive (ending the worker at once raced with those
fetches: `ConnectionResetError` in the rank under load, which reads as a network failure). A queue item of another
shape in a worker ends the worker; other processes' queues keep Python's behaviour.
"""

from __future__ import annotations

import multiprocessing.queues
import os
import sys
import traceback

_PYTHONS = multiprocessing.queues.Queue._on_queue_feeder_error
_said: list[BaseException] = []


def _on_feeder_error(queue: multiprocessing.queues.Queue, error: BaseException, obj: object) -> None:
    """Called by the queue's feeder thread as `self._on_queue_feeder_error(error, obj)`, with the item it dropped."""
    from torch._utils import ExceptionWrapper
    from torch.utils.data import get_worker_info

    worker = get_worker_info()
    if worker is None:  # not a DataLoader worker's queue
        _PYTHONS(error, obj)
        return
    batch = isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], int)  # torch's (index, data)
    if not _said:  # once per worker: its next batches, prefetched, fail alike
        _said.append(error)
        traceback.print_exc()
        print(f"[orch] DataLoader worker {worker.id} (pid {os.getpid()}) could not send a batch to its rank "
              f"({type(error).__name__}): " + ("sending the error in its place" if batch else "ending the worker") +
              ", or the rank would wait for that batch forever", file=sys.stderr, flush=True)  # fmt: skip
    if not batch:
        os._exit(1)
    where = f"in DataLoader worker process {worker.id}"
    queue.put((obj[0], ExceptionWrapper(exc_info=(type(error), error, error.__traceback__), where=where)))


def install() -> None:
    """Before the trainer builds its DataLoader: the workers it forks inherit the hook (a method: it gets the queue)."""
    multiprocessing.queues.Queue._on_queue_feeder_error = _on_feeder_error
