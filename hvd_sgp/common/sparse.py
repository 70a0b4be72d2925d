"""Random-k gossip: PushSum on a random set of entries that every node draws alike.

Why: compressed PushSum (choco.py) moves public copies by compressed differences, and with
random-k a push removes only a fraction F of a difference, so its consensus step must stay
below about F / 2 and the nodes barely mix (digits CNN, n = 8: 0.848 against fp32's 0.979).
Random-k needs none of that. At iteration k every node draws the same entries (the codec's
seed is the iteration) and runs PushSum's exact update on them alone: it pushes its own values
there with the usual weight shares and keeps the rest of its mass where it was. Each entry's
mixing matrix is then either this iteration's (drawn) or the identity (not drawn), both
column stochastic, so the de-biased average is exact and nothing is dropped (there is nothing
for error feedback to send later). Where every matrix is doubly stochastic and delivery is
synchronous, every entry's weight returns to 1 after each iteration, which is why the weight
needs no per-entry storage: nodes keep no public copies and no weights, only their
parameters. An entry mixes in a fraction F of the iterations: Local SGD's schedule, per entry.

Where weights move (Overlap SGP, irregular graphs), entries would need weights of their own,
so random-k gossips through compressed PushSum there (``build`` in mixers.py decides).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from hvd_sgp.common.choco import host_view
from hvd_sgp.common.codecs import WEIGHT_BYTES, Codec, RandomKCodec
from hvd_sgp.common.errors import SgpError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.pushsum import PushSumMixer
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport import Transport


class SparseMixer(PushSumMixer):
    """One node's random-k gossip on one buffer (see the module docstring)."""

    def __init__(self, buffer, topology: Topology, transport: Transport,
                 local: Optional[MPI.Comm] = None, push_sum: bool = True,
                 codec: Optional[Codec] = None):
        super().__init__(host_view(buffer), topology, transport, local, push_sum, codec,
                         track_weight=False)
        if not isinstance(self.codec, RandomKCodec):
            raise SgpValueError(f"random-k gossip needs the randomk codec, got {self.codec!r}")
        if not topology.doubly_stochastic:
            raise SgpValueError(f"random-k gossip keeps every entry's weight at 1, which needs "
                                f"doubly stochastic mixing; {topology!r} is not")
        self.codec_seconds = 0.0  # drawing, gathering and summing in (no communication)
        # the seed, the values in the buffer's own precision (so that the sum over nodes is
        # exactly conserved), the weight share
        self._size = 8 + self.buffer.itemsize * self.codec.count(self.width) + WEIGHT_BYTES
        self._draw = None  # the entries of the iteration begun, for its add

    def begin(self, slot=None):
        """Push this node's values at the iteration's drawn entries; nothing changes here
        until the in-peers' values arrive."""
        began = time.perf_counter()
        phase = self.topology.phase(self.iteration)
        out_peers, in_peers = phase.out_peers[self.node], phase.in_peers(self.node)
        shard = self.buffer[self.start:self.stop]
        draw = self._draw = self.codec.draw(self.iteration, self.width)
        sends = []
        for t, (peer, share) in enumerate(zip(out_peers, phase.out_weights[self.node])):
            message = self._slot.send(t, self._size, True)
            message[:8].view(np.uint64)[0] = self.iteration
            draw.gather(shard, message[8:8 + shard.itemsize * draw.size].view(shard.dtype))
            message[-WEIGHT_BYTES:].view(np.float64)[0] = share
            sends.append((peer, message))
        self.codec_seconds += time.perf_counter() - began
        received = self._slot.receive(len(in_peers), self._size, True)
        pending = self.transport.start(self.iteration, sends,
                                       [(peer, received[t]) for t, peer in enumerate(in_peers)])
        pending.received = received
        return pending

    def add(self, received, sources: list[int]) -> None:
        """Sum the in-peers' values into the drawn entries, each message as PushSum does
        (z += s / (w + s) (z' - z), w += s), from the share this node kept."""
        began = time.perf_counter()
        shard, draw = self.buffer[self.start:self.stop], self._draw
        mixed = draw.gather(shard)
        weight = self.topology.phase(self.iteration).self_weights[self.node]
        for row, source in zip(received, sources):
            seed, share = int(row[:8].view(np.uint64)[0]), float(row[-8:].view(np.float64)[0])
            self._check_weight(share, weight, source)
            if seed != self.iteration:
                raise SgpError(f"{self.transport.peer_name(source)} drew its random-k entries "
                               f"for iteration {seed} while this rank is at "
                               f"{self.iteration}: ranks are running different steps")
            values = row[8:8 + shard.itemsize * draw.size].view(shard.dtype)
            self._check_finite(self.kit.finite(values), source)
            weight += share
            mixed += (share / weight) * (values - mixed)
        draw.set(shard, mixed)
        self.codec_seconds += time.perf_counter() - began
