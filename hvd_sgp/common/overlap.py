"""Overlap SGP: pushes run beside computation with a bounded delay.

Iteration k posts its pushes (copies, tagged with k) and receives, then sums in whatever has
arrived from any earlier iteration, and blocks only for messages of iterations k - max_delay
and older. Messages can land at any later step, so the weight never stays 1: it always travels.
Mass in flight is part of the invariant: sum over nodes plus in flight is conserved.

Memory is bounded: the copies live in a ring of max_delay + 1 reused slots, and a node also
waits for its own pushes of iteration k - max_delay to be taken (its out-peers have reached
that iteration), so at most max_delay iterations stay out between steps.

``in_place`` (tau = 1, uncompressed, one share for every out-peer): the push reads the buffer
itself, as a synchronous one does, instead of a copy. It saves a pass over the model per step
(on shared memory, where no link time hides it, that pass is most of what Overlap SGP costs
beyond its exchange). The push must carry what the copy carried: the parameters right after the
local step, with the weight before any arrival is summed in. So the buffer stays unchanged until
the push is taken, and the arrivals the copying mixer sums in after posting are summed in by
``absorb()`` instead, before the next local step writes the buffer (the engine calls it in
begin_step, after ``release()`` waited for the push). Summing them in before the push instead
(commit 6cc85ba) took every local step at about half the weight, the other half being in flight
without it: the network average moved at about half the learning rate. With tau = 1 the wait
costs nothing: the next iteration waited for the same push anyway, a local step later.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from hvd_sgp.common.codecs import Codec
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.pushsum import PushSumMixer, Slot
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport import Pending, ProgressEngine, Transport


class OverlapMixer(PushSumMixer):
    """One buffer's Overlap SGP state; ``progress`` moves its messages while the node computes."""

    overlapped = True

    def __init__(self, buffer, topology: Topology, transport: Transport,
                 progress: ProgressEngine, local: Optional[MPI.Comm] = None,
                 push_sum: bool = True, codec: Optional[Codec] = None, max_delay: int = 1,
                 in_place: bool = False):
        if max_delay < 1:
            raise SgpValueError(f"max_delay must be >= 1 for Overlap SGP, got {max_delay}")
        super().__init__(buffer, topology, transport, local, push_sum, codec,
                         track_weight=push_sum)
        self.progress = progress
        self.max_delay = max_delay
        self.in_place = in_place and max_delay == 1 and not self._wire and push_sum
        self._absorbed = True  # nothing is in flight yet: the first push may read in place
        self.in_flight: deque[Pending] = deque()
        self._slots: dict[int, Slot] = {}  # by iteration, for the pendings in flight
        self._free: list[Slot] = []

    def mix(self) -> None:
        stale = self.iteration - self.max_delay
        # in place only after absorb(): an adapter that skipped begin_step gets a copy
        in_place = self.in_place and self._absorbed
        self.release()  # (begin writes the weight slot, which the last push may still read)
        slot = self._free.pop() if self._free else Slot(self.kit, self.buffer)
        if in_place:
            pending = self.begin(slot, in_place=True)
        else:  # (a codec mixer's begin() takes the slot only: its pushes are copies)
            pending = self.begin(slot)
        self._slots[pending.iteration] = slot
        self.progress.submit(pending)
        self.in_flight.append(pending)
        self._absorbed = False
        if not in_place:  # the push is a copy: sum in what arrived meanwhile (else absorb())
            self._collect(stale)
            while len(self.in_flight) > self.max_delay:  # receives in: wait for its sends
                self.progress.wait_all(self.in_flight[0])
                self._release()
        self.iteration += 1
        if not in_place:
            self.settle()

    def release(self) -> None:
        """Wait until no push in flight reads the buffer in place (before it is written)."""
        if self.in_place:
            for pending in self.in_flight:
                self.progress.wait_sends(pending)

    def absorb(self) -> None:
        """Before the local step: wait until the push is taken, then sum in what the copying
        mixer's last mix() summed after posting its copy (the messages due, and any that
        arrived since). The next push reads the buffer in place only after this."""
        if self.in_place:
            self.release()
            self._collect(self.iteration - 1 - self.max_delay)
            self.settle()
            self._absorbed = True

    def drain(self) -> None:
        """Sum in every message still in flight (for evaluation, checkpoints, mode switches)."""
        self.release()
        self._collect(stale=self.iteration)
        for pending in self.in_flight:
            self.progress.wait_all(pending)
        self._release()
        self.settle()
        self._absorbed = True

    def abandon(self) -> None:
        """Give up every iteration in flight (a peer was lost): their messages, sent or
        expected, are dropped, never added."""
        super().abandon()
        self.in_flight.clear()
        self._slots.clear()
        self._absorbed = True

    def _collect(self, stale: int) -> None:
        """Add arrived messages; wait for those of iterations <= ``stale``."""
        for pending in self.in_flight:
            if pending.iteration <= stale:
                self.progress.wait_receives(pending)
            self._add_arrived(pending)
        self._release()

    def _release(self) -> None:
        """Retire settled iterations from the front, returning their slots to the ring."""
        while self.in_flight and self._settled(self.in_flight[0]):
            self._free.append(self._slots.pop(self.in_flight.popleft().iteration))

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
