"""Closes that the garbage collector asks for, run at hvd_sgp's next safe point.

A finalizer runs wherever the collector does, also inside an mpi4py call: a pickled
collective holds mpi4py's lock on its table of communicator locks while it allocates one,
and MPI_Comm_free's attribute callback takes that lock. An optimizer collected there freed
its communicator in place, and its rank deadlocked on itself (seen in a repair's allgather).
So a finalizer only queues its close, and hvd_sgp runs the queue between its own MPI calls:
before each step of any optimizer, before the world's subscribers are called (a repair), in
join() once it collected garbage, and at shutdown. A close runs on the collecting rank only.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

_queue: deque[Callable[[], None]] = deque()


def later(close: Callable[[], None]) -> None:
    """Queue ``close`` for the next safe point (call this from a finalizer)."""
    _queue.append(close)


def run() -> None:
    """Run the queued closes, oldest first (each step calls it: an empty queue costs a test)."""
    while _queue:
        try:
            close = _queue.popleft()
        except IndexError:  # (another thread emptied it)
            return
        close()
