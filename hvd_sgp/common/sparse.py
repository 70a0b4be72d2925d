"""Random-k gossip: PushSum on a random set of entries that every node draws alike.

Why: compressed PushSum (choco.py) moves public copies by compressed differences, and with
random-k a push removes only a fraction F of a difference, so its consensus step must stay
below about F / 2 and the nodes barely mix (digits CNN, n = 8: 0.848 against fp32's 0.979).
Random-k needs none of that. At iteration k every node draws the same entries (the codec's
seed is the iteration) and runs PushSum's exact update on them alone: it pushes its own values
there with the usual weight shares and keeps the rest of its mass where it was. Each entry's
mixing matrix is then either this iteration's (drawn) or the identity (not drawn), both
column stochastic, so the de-biased average is exact and nothing is dropped (there is nothing
for error feedback to send later). An entry mixes in a fraction F of the iterations: Local
SGD's schedule, per entry. Nodes keep no public copies.

Weights. Entries are drawn in fixed runs of consecutive entries (codecs.Draw), so the entries
of a run always move together and share one PushSum weight: a node keeps one float64 weight
per run (1/64 of the shard's values for large shards) and a push carries the weight share of
each run it carries, 8 bytes per run. Where every matrix is doubly stochastic and delivery is
synchronous every weight returns to 1 after each iteration, so there the weights are neither
stored nor sent. Where they move (Overlap SGP, irregular graphs) they are tracked, and a
message can be summed in whenever it arrives: sums commute, and the message names its draw.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from hvd_sgp.common.arrays import host_view
from hvd_sgp.common.codecs import WEIGHT_BYTES, Codec, Draw, RandomKCodec
from hvd_sgp.common.errors import SgpError, SgpValueError
from hvd_sgp.common.pushsum import Part, PushSumMixer, Slot
from hvd_sgp.common.timing import Timing
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport_protocol import Transport

SEED_BYTES = 8  # a message starts with the iteration whose draw it carries


class SparseMixer(PushSumMixer):
    """One node's random-k gossip on one buffer (see the module docstring): the codec part of
    a mixer, under either timing part. ``weighted`` tracks a weight per run (None: where
    weights move, i.e. on graphs that are not doubly stochastic, and under Overlap SGP)."""

    def __init__(self, buffer, topology: Topology, transport: Transport,
                 shard: Optional[Callable[[Any], Part]] = None, push_sum: bool = True,
                 codec: Optional[Codec] = None, weighted: Optional[bool] = None, *,
                 timing: Optional[Timing] = None, slot: Optional[Slot] = None):
        super().__init__(host_view(buffer), topology, transport, shard, push_sum, codec,
                         timing=timing, slot=slot)
        if not isinstance(self.codec, RandomKCodec):
            raise SgpValueError(f"random-k gossip needs the randomk codec, got {self.codec!r}")
        doubly = self.topology.doubly_stochastic
        if not self.push_sum and not doubly:
            raise SgpValueError(f"random-k gossip without PushSum weights needs doubly "
                                f"stochastic mixing; {self.topology!r} is not")
        self.track_weight = False  # the scalar slot stays 1: the weights are per run
        drawn, runs = self.codec.runs(self.width)
        weighted = (not doubly or self.timing.overlapped if weighted is None
                    else weighted) and self.push_sum
        self.run_weights = np.ones(runs) if weighted else None
        self.codec_seconds = 0.0  # drawing, gathering and summing in (no communication)
        # the seed, each drawn run's weight share (float64, where tracked), the values in the
        # buffer's own precision (so that the sum over nodes is exactly conserved), the
        # iteration's share
        self._shares = 8 * drawn if weighted else 0
        self._size = (SEED_BYTES + self._shares
                      + self.buffer.itemsize * self.codec.count(self.width) + WEIGHT_BYTES)
        self._draws: dict[int, Draw] = {}  # by iteration, for the messages still to come

    def _draw(self, iteration: int) -> Draw:
        draw = self._draws.get(iteration)
        if draw is None:
            draw = self._draws[iteration] = self.codec.draw(iteration, self.width)
        return draw

    def begin(self, slot: Optional[Slot] = None):
        """Push this node's values at the iteration's drawn entries, with each run's weight
        share; keep the rest of the weight (nothing else changes until messages arrive)."""
        began = time.perf_counter()
        slot = slot if slot is not None else self.slot
        phase = self.topology.phase(self.iteration)
        out_peers, in_peers = phase.out_peers[self.node], phase.in_peers(self.node)
        shard = self.buffer[self.start:self.stop]
        for old in [k for k in self._draws if k < self.iteration - self.timing.max_delay]:
            del self._draws[old]
        draw = self._draw(self.iteration)
        weights = None if self.run_weights is None else self.run_weights[draw.runs]
        sends = []
        for t, (peer, share) in enumerate(zip(out_peers, phase.out_weights[self.node])):
            message = slot.send(t, self._size, True)
            seed, shares, values, _ = self._parts(message, draw)
            seed[0] = self.iteration
            if weights is not None:
                np.multiply(weights, share, out=shares)
            draw.gather(shard, values)
            message[-WEIGHT_BYTES:].view(np.float64)[0] = share
            sends.append((peer, message))
        if weights is not None:
            self.run_weights[draw.runs] = weights * phase.self_weights[self.node]
        self.codec_seconds += time.perf_counter() - began
        received = slot.receive(len(in_peers), self._size, True)
        pending = self.transport.start(self.iteration, sends,
                                       [(peer, received[t]) for t, peer in enumerate(in_peers)])
        pending.received = received
        return pending

    def _parts(self, row: np.ndarray, draw: Optional[Draw] = None):
        """(seed, run shares, values, share) views of a message (the values of ``draw``,
        which the seed names, when given)."""
        values = row[SEED_BYTES + self._shares:-WEIGHT_BYTES].view(self.buffer.dtype)
        return (row[:SEED_BYTES].view(np.uint64), row[SEED_BYTES:SEED_BYTES + self._shares]
                .view(np.float64), values[:draw.size] if draw is not None else values,
                row[-WEIGHT_BYTES:].view(np.float64))

    def _message_draw(self, row: np.ndarray, source: int) -> Draw:
        seed = int(row[:SEED_BYTES].view(np.uint64)[0])
        if not 0 <= self.iteration - seed <= self.timing.max_delay:
            raise SgpError(f"{self.transport.peer_name(source)} drew its random-k entries "
                           f"for iteration {seed} while this rank is at "
                           f"{self.iteration}: ranks are running different steps")
        return self._draw(seed)

    def add(self, received, sources: list[int]) -> None:
        """Sum the in-peers' values into the drawn entries, each message as PushSum does
        (z += s / (w + s) (z' - z), w += s), per run where weights are tracked. Consecutive
        messages of one draw (a synchronous iteration's) share one gather and one set."""
        began = time.perf_counter()
        shard = self.buffer[self.start:self.stop]
        # untracked, every weight was 1: a drawn entry starts from the share the node kept
        weight = self.topology.phase(self.iteration).self_weights[self.node]
        current, mixed = None, None
        for row, source in zip(received, sources):
            draw = self._message_draw(row, source)
            _, shares, values, share = self._parts(row, draw)
            share = float(share[0])
            self._check_weight(share, weight, source)
            self._check_finite(self.kit.finite(values) and np.isfinite(shares).all()
                               and (shares > 0).all(), source)
            if draw is not current:
                if current is not None:
                    current.set(shard, mixed)
                current, mixed = draw, draw.gather(shard)
            if self.run_weights is None:
                weight += share
                mixed += (share / weight) * (values - mixed)
            else:
                total = self.run_weights[draw.runs] + shares
                mixed += draw.spread(shares / total).astype(mixed.dtype) * (values - mixed)
                self.run_weights[draw.runs] = total
        if current is not None:
            current.set(shard, mixed)
        self.codec_seconds += time.perf_counter() - began

    def entry_weights(self) -> Optional[np.ndarray]:
        """Each shard entry's PushSum weight (None where every weight is 1), for the exact
        average that folds them in."""
        if self.run_weights is None:
            return None
        return np.repeat(self.run_weights, self.codec.run(self.width))[:self.width]

    def carried(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The mass a message carries, entry by entry: (numerators s z', weight shares s);
        zero where it carries nothing (for the simulator's ledger of what is in flight)."""
        draw = self.codec.draw(int(row[:SEED_BYTES].view(np.uint64)[0]), self.width)
        _, shares, values, share = self._parts(row, draw)
        weights = np.zeros(self.width)
        draw.set(weights, draw.spread(shares) if self.run_weights is not None
                 else np.full(draw.size, float(share[0])))
        numerators = np.zeros(self.width)
        draw.set(numerators, draw.gather(weights) * values)
        return numerators, weights

    def reset_weights(self) -> None:
        """After the exact average: every weight is 1."""
        if self.run_weights is not None:
            self.run_weights[...] = 1

    def state(self) -> dict:
        return {} if self.run_weights is None else {"run_weights": self.run_weights.copy()}

    def load_state(self, state: dict) -> None:
        weights = state.get("run_weights")
        if weights is None or self.run_weights is None:
            return
        if len(weights) != len(self.run_weights):
            raise SgpValueError(f"checkpoint's random-k weights are for {len(weights)} runs, "
                                f"this model's shard has {len(self.run_weights)}")
        self.run_weights[...] = weights
