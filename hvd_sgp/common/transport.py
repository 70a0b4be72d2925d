"""Point-to-point exchange of one fused buffer per peer per iteration over MPI, with a deadline
(the Transport and ProgressEngine of transport_protocol.py).

Every send and receive is non-blocking (Isend/Irecv on a private communicator, tagged with the
iteration), and waits poll with a deadline, so a dead or frozen peer becomes a
PeerTimeoutError naming that peer and the iteration instead of a hang. In fault-tolerant mode
both become PeerLostError instead (see recovery.py), which the survivors repair.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from hvd_sgp.common import place, recovery
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.transport_protocol import Pending, TransportStats
from hvd_sgp.common.waiting import Wait
from hvd_sgp.common.world import track, untrack

_TAG_SPACE = 32767  # the MPI standard guarantees tags up to this
DEFAULT_TIMEOUT = 300.0  # seconds; the optimizers take theirs from the options table


def tag_of(iteration: int) -> int:
    return iteration % _TAG_SPACE


class PeerTransport:
    """Sends and receives of fused buffers between ranks of one communicator."""

    def __init__(self, comm: MPI.Comm, timeout: float | None = None):
        self.comm = comm.Dup()  # private: our tags never meet the user's messages
        track(self.comm)  # revoked with the world when a peer is lost
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.stats = TransportStats()
        # errors name peers by launch rank (a replacement's: its own, place.origin_rank),
        # whatever communicator (cross-node) carries them
        self.world_ranks = self.comm.allgather(place.origin_rank() if place.is_initialized()
                                               else MPI.COMM_WORLD.Get_rank())
        self.timeline = None  # a telemetry.Timeline records the waits when set

    def start(self, iteration: int, sends: Sequence[tuple[int, Any]],
              receives: Sequence[tuple[int, Any]]) -> Pending:
        """Post this iteration's receives, then its sends; returns the requests to wait on
        (receives first, in the order given)."""
        with recovery.translated(f"the exchange of iteration {iteration}"):
            return self._start(iteration, sends, receives)

    def _start(self, iteration: int, sends: Sequence[tuple[int, Any]],
               receives: Sequence[tuple[int, Any]]) -> Pending:
        pending = Pending(iteration)
        tag = tag_of(iteration)
        for peer, buf in receives:
            pending.requests.append(self.comm.Irecv(buf, source=peer, tag=tag))
            pending.peers.append(peer)
            pending.kinds.append("receive")
        for peer, buf in sends:
            pending.requests.append(self.comm.Isend(buf, dest=peer, tag=tag))
            pending.buffers.append(buf)
            pending.peers.append(peer)
            pending.kinds.append("send")
            self.stats.bytes_sent += _nbytes(buf)
            self.stats.messages_sent += 1
        return pending

    def wait(self, pending: Pending) -> None:
        """Block until every request completes, or raise PeerTimeoutError past the deadline."""
        began = time.monotonic()
        with recovery.translated(f"the exchange of iteration {pending.iteration}"):
            if not MPI.Request.Testall(pending.requests):
                self.waiting(pending, lambda: [not r.Test() for r in pending.requests],
                             began).until(lambda: MPI.Request.Testall(pending.requests))
        self.record_wait(pending, began)

    def waiting(self, pending: Pending, late: Callable[[], Sequence[bool]],
                began: float) -> Wait:
        """The wait on ``pending``'s peers; ``late()`` flags its requests not yet complete."""
        return Wait("the exchange", lambda: self.describe(pending, late()), self.timeout,
                    pending.iteration, began=began)

    def record_wait(self, pending: Pending, began: float) -> None:
        """Count a finished wait (and draw it on the timeline)."""
        ended = time.monotonic()
        self.stats.record_wait(ended - began)
        if self.timeline is not None and ended - began > 1e-5:
            self.timeline.ended_now("wait", ended - began, iteration=pending.iteration)

    def peer_name(self, peer: int) -> str:
        return f"rank {self.world_ranks[peer]}"

    def describe(self, pending: Pending, late: Sequence[bool]) -> str:
        """Who has not delivered yet, by world rank."""
        names = [f"{kind} with {self.peer_name(peer)}"
                 for is_late, peer, kind in zip(late, pending.peers, pending.kinds) if is_late]
        return ", ".join(names) or "peers"

    def free(self) -> None:
        untrack(self.comm)
        recovery.free(self.comm)


def _nbytes(buf: Any) -> int:
    if isinstance(buf, (list, tuple)):  # [array, count, datatype]
        return int(buf[1]) * buf[2].Get_size()
    return int(buf.nbytes)


class Progress:
    """A background thread that drives MPI progress on requests in flight (Overlap SGP).

    The thread alone tests the requests it was given; the training thread only reads their
    completion flags, so no request is touched by two threads (MPI_THREAD_MULTIPLE is still
    needed: both threads call MPI).
    """

    def __init__(self, transport: PeerTransport, pause: float = 1e-3):
        self.transport = transport
        self._pause = pause
        self._cond = threading.Condition()
        self._active: list[Pending] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hvd_sgp-progress", daemon=True)
        self._thread.start()

    def submit(self, pending: Pending) -> None:
        with self._cond:
            pending.complete = [False] * len(pending.requests)
            self._active.append(pending)
            self._cond.notify_all()

    def _run(self) -> None:
        pause = 2e-5
        while True:
            with self._cond:
                while not self._active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = list(self._active)
            finished, failed = [], False
            for p in batch:
                try:
                    finished += [(p, i) for i, req in enumerate(p.requests)
                                 if not p.complete[i] and req.Test()]
                except MPI.Exception as error:  # a lost peer: the waiter raises it
                    p.error, failed = error, True
            with self._cond:
                for p, i in finished:
                    p.complete[i] = True
                self._active = [p for p in self._active
                                if not all(p.complete) and p.error is None]
                if failed:
                    self._cond.notify_all()
                if finished:
                    self._cond.notify_all()
            pause = 2e-5 if finished else min(pause * 2, self._pause)
            time.sleep(pause)

    def wait_receives(self, pending: Pending) -> None:
        """Block until every receive of ``pending`` has completed, or raise past the deadline."""
        self._wait(pending, lambda p: all(c for c, k in zip(p.complete, p.kinds) if k == "receive"))

    def wait_sends(self, pending: Pending) -> None:
        """Block until every send of ``pending`` has completed, or raise past the deadline."""
        self._wait(pending, lambda p: all(c for c, k in zip(p.complete, p.kinds) if k == "send"))

    def wait_all(self, pending: Pending) -> None:
        self._wait(pending, lambda p: all(p.complete))

    def _wait(self, pending: Pending, ready) -> None:
        began = time.monotonic()
        wait = self.transport.waiting(pending, lambda: [not done for done in pending.complete],
                                      began)
        with self._cond:
            while not ready(pending) and pending.error is None:
                wait.due()
                self._cond.wait(0.5)
        if pending.error is not None:
            with recovery.translated(f"the exchange of iteration {pending.iteration}"):
                raise pending.error
        self.transport.record_wait(pending, began)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
