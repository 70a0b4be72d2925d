"""Overlap SGP: pushes run beside computation with a bounded delay.

Iteration k posts its pushes (copies, tagged with k) and receives, then sums in whatever has
arrived from any earlier iteration, and blocks only for messages of iterations k - max_delay
and older. Messages can land at any later step, so the weight never stays 1: it always travels.
Mass in flight is part of the invariant: sum over nodes plus in flight is conserved.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from hvd_sgp.common.compression import Codec
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.pushsum import PushSumMixer
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport import Pending, PeerTransport, Progress


class OverlapMixer(PushSumMixer):
    """One buffer's Overlap SGP state; ``progress`` is the background thread moving messages."""

    def __init__(self, buffer, topology: Topology, transport: PeerTransport,
                 progress: Progress, local: Optional[MPI.Comm] = None, push_sum: bool = True,
                 codec: Optional[Codec] = None, max_delay: int = 1):
        if max_delay < 1:
            raise SgpValueError(f"max_delay must be >= 1 for Overlap SGP, got {max_delay}")
        super().__init__(buffer, topology, transport, local, push_sum, codec,
                         track_weight=push_sum)
        self.progress = progress
        self.max_delay = max_delay
        self.in_flight: deque[Pending] = deque()

    def mix(self) -> None:
        pending = self.begin(detach=True)
        self.progress.submit(pending)
        self.in_flight.append(pending)
        self._collect(stale=self.iteration - self.max_delay)
        self.iteration += 1
        self.settle()

    def drain(self) -> None:
        """Sum in every message still in flight (for evaluation, checkpoints, mode switches)."""
        self._rebias()
        self._collect(stale=self.iteration)
        for pending in self.in_flight:
            self.progress.wait_all(pending)
        self.in_flight.clear()
        self.settle()

    def _rebias(self) -> None:
        if self.track_weight:
            self.buffer[self.start:self.stop] *= self.buffer[self.n]

    def _collect(self, stale: int) -> None:
        """Add arrived messages; wait for those of iterations <= ``stale``."""
        for pending in self.in_flight:
            if pending.iteration <= stale:
                self.progress.wait_receives(pending)
            self._add_arrived(pending)
        while self.in_flight and self._settled(self.in_flight[0]):
            self.in_flight.popleft()

    def _add_arrived(self, pending: Pending) -> None:
        # receives come first in a Pending, one per row of pending.received
        rows = [t for t in range(len(pending.received))
                if pending.complete[t] and t not in pending.added]
        if rows:
            sources = pending.sources()
            self.add([pending.received[t] for t in rows], [sources[t] for t in rows])
            pending.added.update(rows)

    @staticmethod
    def _settled(pending: Pending) -> bool:
        return len(pending.added) == len(pending.received) and all(pending.complete)
