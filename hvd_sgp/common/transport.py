"""Point-to-point exchange of one fused buffer per peer per iteration, with a deadline.

Every send and receive is non-blocking (Isend/Irecv on a private communicator, tagged with the
iteration), and waits poll with a deadline, so a dead or frozen peer becomes a
PeerTimeoutError naming that peer and the iteration instead of a hang.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from mpi4py import MPI

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
        """Post this iteration's receives, then its sends; returns the requests to wait on."""
        pending = Pending(iteration)
        tag = tag_of(iteration)
        for peer, buf in receives:
            pending.requests.append(self.comm.Irecv(buf, source=peer, tag=tag))
            pending.peers.append(peer)
            pending.kinds.append("receive")
        for peer, buf in sends:
            pending.requests.append(self.comm.Isend(buf, dest=peer, tag=tag))
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
