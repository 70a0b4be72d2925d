"""When a mixer's messages travel: the timing part of a mixer.

A mixer is composed of two parts. Its class is the codec part, what a message carries: the
parameters themselves (pushsum.PushSumMixer), compressed differences against public copies
(choco.ChocoMixer) or shared random entries (sparse.SparseMixer). Its ``timing`` is this part:
``Synchronous`` (every iteration completes within ``mix()``) or ``overlap.Overlap`` (pushes run
beside computation with a bounded delay). mixers.build picks the two; each timing object
drives the one mixer it was given to.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from hvd_sgp.common.errors import SgpValueError

if TYPE_CHECKING:
    from hvd_sgp.common.pushsum import PushSumMixer


class Timing:
    """What every timing part offers a mixer; the defaults are those of a schedule that leaves
    nothing in flight between iterations."""

    overlapped = False  # whether messages stay in flight between iterations
    max_delay = 0  # how many iterations late a message may be summed in
    in_flight: Sequence = ()  # the iterations still in flight, oldest first

    def __init__(self) -> None:
        self.mixer: "PushSumMixer | None" = None

    def attach(self, mixer: "PushSumMixer") -> None:
        """Drive ``mixer`` (called by the mixer's constructor): one timing object per mixer,
        since it holds that mixer's messages in flight."""
        if self.mixer is not None:
            raise SgpValueError(f"this {type(self).__name__} timing already drives a mixer of "
                                f"node {self.mixer.node}: build one timing object per mixer")
        self.mixer = mixer

    def mix(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Wait until no push in flight reads the buffer in place: none does here."""

    def absorb(self) -> None:
        """Sum in what an in-place push kept out of the buffer: nothing here."""

    def drain(self) -> None:
        """Sum in every message still in flight: none is here."""

    def abandon(self) -> None:
        """Drop the iterations in flight (a peer was lost): none is here."""


class Synchronous(Timing):
    """Each iteration's messages are posted, awaited and summed in within ``mix()``."""

    def mix(self) -> None:
        self.mixer.finish(self.mixer.begin())
