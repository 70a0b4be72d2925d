"""Overlap SGP: pushes run beside computation with a bounded delay (a mixer's timing part,
for any codec part: see timing.py).

Iteration k posts its pushes (copies, tagged with k) and receives, then sums in whatever has
arrived from any earlier iteration, and blocks only for messages of iterations k - max_delay
and older. Messages can land at any later step, so the weight never stays 1: it always travels.
Mass in flight is part of the invariant: sum over nodes plus in flight is conserved. A codec
part whose messages depend on the ones before (``ordered``: compressed PushSum's differences)
has a peer's message wait while an older one from that peer is still out.

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

from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.pushsum import PushSumMixer, Slot
from hvd_sgp.common.timing import Timing
from hvd_sgp.common.transport_protocol import Pending, ProgressEngine


class Overlap(Timing):
    """One mixer's Overlap SGP schedule; ``progress`` moves its messages while the node
    computes. ``in_place`` asks for the copy-free push at tau = 1 (where the codec part's
    pushes can read the buffer, ``PushSumMixer.reads_in_place``)."""

    overlapped = True

    def __init__(self, progress: ProgressEngine, max_delay: int = 1, in_place: bool = False):
        if max_delay < 1:
            raise SgpValueError(f"max_delay must be >= 1 for Overlap SGP, got {max_delay}")
        super().__init__()
        self.progress = progress
        self.max_delay = max_delay
        self.in_place = in_place and max_delay == 1
        self._absorbed = True  # nothing is in flight yet: the first push may read in place
        self.in_flight: deque[Pending] = deque()
        self._slots: dict[int, Slot] = {}  # by iteration, for the pendings in flight
        self._free: list[Slot] = []

    def attach(self, mixer: PushSumMixer) -> None:
        super().attach(mixer)
        self.in_place = self.in_place and mixer.reads_in_place()
        self._free.append(mixer.slot)  # the ring starts with the mixer's own storage

    def mix(self) -> None:
        mixer = self.mixer
        stale = mixer.iteration - self.max_delay
        # in place only after absorb(): an adapter that skipped begin_step gets a copy
        in_place = self.in_place and self._absorbed
        self.release()  # (begin writes the weight slot, which the last push may still read)
        slot = self._free.pop() if self._free else Slot(mixer.kit, mixer.buffer)
        if in_place:
            pending = mixer.begin(slot, in_place=True)
        else:  # (a compressed codec part's begin() takes the slot only: its pushes are copies)
            pending = mixer.begin(slot)
        self._slots[pending.iteration] = slot
        self.progress.submit(pending)
        self.in_flight.append(pending)
        self._absorbed = False
        if not in_place:  # the push is a copy: sum in what arrived meanwhile (else absorb())
            self._collect(stale)
            while len(self.in_flight) > self.max_delay:  # receives in: wait for its sends
                self.progress.wait_all(self.in_flight[0])
                self._release()
        mixer.iteration += 1
        if not in_place:
            mixer.settle()

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
            self._collect(self.mixer.iteration - 1 - self.max_delay)
            self.mixer.settle()
            self._absorbed = True

    def drain(self) -> None:
        """Sum in every message still in flight (for evaluation, checkpoints, mode switches)."""
        self.release()
        self._collect(stale=self.mixer.iteration)
        for pending in self.in_flight:
            self.progress.wait_all(pending)
        self._release()
        self.mixer.settle()
        self._absorbed = True

    def abandon(self) -> None:
        """Give up every iteration in flight (a peer was lost): their messages, sent or
        expected, are dropped, never added."""
        self.in_flight.clear()
        self._slots.clear()
        self._absorbed = True

    def _collect(self, stale: int) -> None:
        """Add arrived messages, oldest iteration first; wait for those of iterations <=
        ``stale``. Where the codec part is ``ordered``, a peer's message waits while an older
        one from that peer is still out."""
        behind: set[int] = set()  # peers with an older message still out (ordered only)
        for pending in self.in_flight:
            if pending.iteration <= stale:
                self.progress.wait_receives(pending)
            self._add_arrived(pending, behind)
        self._release()

    def _add_arrived(self, pending: Pending, behind: set[int]) -> None:
        # receives come first in a Pending, one per row of pending.received
        sources = pending.sources()
        rows = []
        for t, source in enumerate(sources):
            if t in pending.added:
                continue
            if pending.complete[t] and source not in behind:
                rows.append(t)
            elif self.mixer.ordered:
                behind.add(source)
        if rows:
            self.mixer.add([pending.received[t] for t in rows], [sources[t] for t in rows])
            pending.added.update(rows)

    def _release(self) -> None:
        """Retire settled iterations from the front, returning their slots to the ring."""
        while self.in_flight and self._settled(self.in_flight[0]):
            self._free.append(self._slots.pop(self.in_flight.popleft().iteration))

    @staticmethod
    def _settled(pending: Pending) -> bool:
        return len(pending.added) == len(pending.received) and all(pending.complete)
