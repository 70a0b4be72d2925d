"""Blocking MPI calls as the watchdog sees them: a watched communicator records the blocking
collective each thread is in (``calls``), and ``doing`` names what the thread does meanwhile
(``activity``). watchdog.py's thread reads both; the world's communicators are watched ones.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from hvd_sgp.common.mpi import MPI

calls: dict[int, list] = {}  # thread id -> [began, comm, call name, warned]
activity: dict[int, tuple] = {}  # thread id -> (what, iteration, since, owner)

_BLOCKING = ("Allreduce", "allreduce", "Allgather", "Allgatherv", "allgather", "Bcast",
             "bcast", "Barrier", "barrier", "Reduce", "reduce", "Gather", "Gatherv", "gather",
             "Scatter", "scatter", "Alltoall", "Alltoallv", "alltoall", "Reduce_scatter",
             "Dup", "Split", "Split_type", "Create", "Create_group")


def _watching(name: str):
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        key = threading.get_ident()
        calls[key] = [time.monotonic(), self, name, False]
        try:
            return method(self, *args, **kwargs)
        finally:
            calls.pop(key, None)

    call.__name__ = name
    call.__doc__ = f"MPI's {name}, under the watchdog's deadline."
    return call


WatchedComm = type("WatchedComm", (MPI.Intracomm,),
                   {"__doc__": "An intracommunicator whose blocking collectives are watched "
                               "(Dup and Split give watched ones too).",
                    **{name: _watching(name) for name in _BLOCKING}})


def watched(comm: MPI.Comm) -> MPI.Comm:
    """``comm`` (the same handle) with its blocking collectives under the deadline."""
    if isinstance(comm, WatchedComm) or comm == MPI.COMM_NULL or comm.Is_inter():
        return comm
    return WatchedComm(comm)


class doing:
    """Name what this thread is doing (a context manager), for the watchdog's messages: 'the
    gradient sum' at iteration 5, say; ``owner``: the optimizer's engine whose step it is (its
    serial, equal on every rank), so that ranks in different parts of one engine's step show
    up as such (checkpoint.out_of_step)."""

    __slots__ = ("entry", "key", "previous", "owner")

    def __init__(self, what: str, iteration: Optional[int] = None, owner: Optional[int] = None):
        self.entry, self.key, self.owner = (what, iteration), threading.get_ident(), owner

    def __enter__(self) -> None:
        self.previous = activity.get(self.key)
        activity[self.key] = (*self.entry, time.monotonic(), self.owner)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is None:
            activity.pop(self.key, None)
        else:
            activity[self.key] = self.previous
