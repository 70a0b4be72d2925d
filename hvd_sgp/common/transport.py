"""Point-to-point exchange of one fused buffer per peer per iteration, with a deadline.

Every send and receive is non-blocking (Isend/Irecv on a private communicator, tagged with the
iteration), and waits poll with a deadline, so a dead or frozen peer becomes a
PeerTimeoutError naming that peer and the iteration instead of a hang.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from hvd_sgp.common.mpi import MPI

from hvd_sgp.common import options
from hvd_sgp.common.errors import PeerTimeoutError

_TAG_SPACE = 32767  # the MPI standard guarantees tags up to this


@dataclass
class TransportStats:
    """Cheap per-rank counters: kept always, read by telemetry."""

    bytes_sent: int = 0
    messages_sent: int = 0
    wait_seconds: float = 0.0
    last_wait_seconds: float = 0.0


@dataclass
class Pending:
    """Requests of one iteration still in flight, with who is on the other end."""

    iteration: int
    requests: list = field(default_factory=list)
    peers: list = field(default_factory=list)
    kinds: list = field(default_factory=list)  # "send" or "receive"
    received: Any = None  # the caller's receive buffers, one row per source
    complete: list = field(default_factory=list)  # per request, kept by Progress
    added: set = field(default_factory=set)  # receive rows already summed in (overlap)
    buffers: list = field(default_factory=list)  # alive until the requests complete

    def sources(self) -> list[int]:
        return [peer for peer, kind in zip(self.peers, self.kinds) if kind == "receive"]


def tag_of(iteration: int) -> int:
    return iteration % _TAG_SPACE


class PeerTransport:
    """Sends and receives of fused buffers between ranks of one communicator."""

    def __init__(self, comm: MPI.Comm, timeout: float | None = None):
        self.comm = comm.Dup()  # private: our tags never meet the user's messages
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = options.resolve().timeout if timeout is None else timeout
        self.stats = TransportStats()

    def start(self, iteration: int, sends: Sequence[tuple[int, Any]],
              receives: Sequence[tuple[int, Any]]) -> Pending:
        """Post this iteration's receives, then its sends; returns the requests to wait on
        (receives first, in the order given)."""
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

    def done(self, pending: Pending) -> bool:
        """Progress the requests without blocking; True when all have completed."""
        return bool(MPI.Request.Testall(pending.requests))

    def wait(self, pending: Pending) -> None:
        """Block until every request completes, or raise PeerTimeoutError past the deadline."""
        began = time.monotonic()
        if not MPI.Request.Testall(pending.requests):
            deadline = began + self.timeout
            pause = 2e-6
            while not MPI.Request.Testall(pending.requests):
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(self._late(pending))
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
        waited = time.monotonic() - began
        self.stats.wait_seconds += waited
        self.stats.last_wait_seconds = waited

    def _late(self, pending: Pending) -> str:
        late = [f"{kind} with rank {peer}"
                for req, peer, kind in zip(pending.requests, pending.peers, pending.kinds)
                if req != MPI.REQUEST_NULL and not req.Test()]
        return (f"waited {self.timeout:.0f} s at iteration {pending.iteration} for "
                f"{', '.join(late) or 'peers'} (dead or frozen peer, or ranks running different "
                "steps); raise HVD_SGP_TIMEOUT if this is a slow start")

    def free(self) -> None:
        if not MPI.Is_finalized():
            self.comm.Free()


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
            finished = [(p, i) for p in batch for i, req in enumerate(p.requests)
                        if not p.complete[i] and req.Test()]
            with self._cond:
                for p, i in finished:
                    p.complete[i] = True
                self._active = [p for p in self._active if not all(p.complete)]
                if finished:
                    self._cond.notify_all()
            pause = 2e-5 if finished else min(pause * 2, self._pause)
            time.sleep(pause)

    def wait_receives(self, pending: Pending) -> None:
        """Block until every receive of ``pending`` has completed, or raise past the deadline."""
        self._wait(pending, lambda p: all(c for c, k in zip(p.complete, p.kinds) if k == "receive"))

    def wait_all(self, pending: Pending) -> None:
        self._wait(pending, lambda p: all(p.complete))

    def _wait(self, pending: Pending, ready) -> None:
        began = time.monotonic()
        deadline = began + self.transport.timeout
        with self._cond:
            while not ready(pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [f"{kind} with rank {peer}" for done, peer, kind
                            in zip(pending.complete, pending.peers, pending.kinds) if not done]
                    raise PeerTimeoutError(
                        f"waited {self.transport.timeout:.0f} s at iteration {pending.iteration} "
                        f"for {', '.join(late)} (dead or frozen peer)")
                self._cond.wait(min(left, 0.5))
        waited = time.monotonic() - began
        self.transport.stats.wait_seconds += waited
        self.transport.stats.last_wait_seconds = waited

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
