"""What a mixer needs of the network between nodes, as protocols: ``Transport`` posts one
iteration's sends and receives and waits for them, ``ProgressEngine`` moves Overlap SGP's
messages while the node computes; ``Pending`` and ``TransportStats`` are what they hand back.
MPI implements them in transport.py, the simulator in sim/network.py; no MPI here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass
class TransportStats:
    """Cheap per-rank counters: kept always, read by telemetry."""

    bytes_sent: int = 0
    messages_sent: int = 0
    wait_seconds: float = 0.0
    last_wait_seconds: float = 0.0

    def record_wait(self, seconds: float) -> None:
        self.wait_seconds += seconds
        self.last_wait_seconds = seconds


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
    error: Any = None  # an MPI error the progress thread met on these requests

    def sources(self) -> list[int]:
        return [peer for peer, kind in zip(self.peers, self.kinds) if kind == "receive"]


class Transport(Protocol):
    """What a mixer needs of the network between nodes: post one iteration's sends and
    receives, wait for them, and name a peer in errors. MPI (PeerTransport) and the simulator
    (sim/network.py) implement it."""

    rank: int
    size: int
    timeout: float
    stats: TransportStats

    def start(self, iteration: int, sends: Sequence[tuple[int, Any]],
              receives: Sequence[tuple[int, Any]]) -> Pending: ...

    def wait(self, pending: Pending) -> None: ...

    def peer_name(self, peer: int) -> str: ...

    def free(self) -> None: ...


class ProgressEngine(Protocol):
    """Moves an Overlap SGP iteration's messages while the node computes (Progress over MPI,
    simulated time in the simulator); the mixer only reads ``pending.complete``."""

    def submit(self, pending: Pending) -> None: ...

    def wait_receives(self, pending: Pending) -> None: ...

    def wait_sends(self, pending: Pending) -> None: ...

    def wait_all(self, pending: Pending) -> None: ...

    def close(self) -> None: ...
