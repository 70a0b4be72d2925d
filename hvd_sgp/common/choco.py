"""Compressed PushSum: lossy codecs (int8, top-k; random-k gossips exactly, sparse.py)
without drift, on directed, time-varying graphs, synchronous or overlapped.

Why: pushing an encoding of the parameters loses a little mass at every step, so the de-biased
average drifts away. As in CHOCO-SGD (Koloskova et al., 2019), nodes gossip encoded
*differences* against public copies that sender and receiver update identically, and move mass
by those copies with a consensus step gamma. PushSum's column-stochastic weights replace
CHOCO's symmetric ones. Node i at iteration k, with de-biased parameters z_i = x_i / w_i,
out-peers j and shares p_ji, and s_ji = gamma p_ji w_i (the weight share, an exact float64):

    for each out-peer j:   q = Q(z_i - r_ij)      r_ij = c_ij (error feedback) or z_i at
                           c_ij += dec(q)                the last push to j (no feedback)
    then:                  x_i -= sum_j s_ji c_ij,    w_i -= sum_j s_ji
    from each in-peer j:   c_ji += dec(q);  x_i += s_ij c_ji;  w_i += s_ij

c_ij is the copy of z_i that node j holds: the sender removes exactly the mass the receiver
adds (the same float64 share times the same copy), so sum_i x_i and sum_i w_i (plus what is in
flight) are invariant for any codec, and the de-biased average sum_i x_i / sum_i w_i never
drifts. The copies follow z, not x: on graphs whose weights move, the numerators oscillate with
the weights even at consensus, and their differences would never shrink. While the copies track
z (the codec's error shrinks through error feedback) this is PushSum with the matrix
(1 - gamma) I + gamma P; with an exact codec and gamma = 1 it is PushSum itself. Without error
feedback the part of each difference that the codec drops is never sent again, and the copies
keep that error.

What a node stores. On a time-varying directed graph a node pushes to a different peer each
iteration, and a peer that did not hear an update cannot apply the next difference; so the
copies live per edge: one per out-peer the node ever pushes to (its side of c_ij) and one per
in-peer it ever receives from (c_ji), and without error feedback one more per out-peer (r_ij).
Each is a copy of the shard. For the one-peer exponential graph on n nodes that is
2 ceil(log2 n) copies (3 ceil(log2 n) without error feedback), e.g. 6 at n = 8; a ring needs
2. The first message on an edge carries the shard exactly, so every copy starts equal to the
parameters. Messages: [gamma p, weight share, raw flag] as float64, then the payload.

Overlap SGP (the timing part overlap.Overlap): messages on one edge must be applied in the
order they were sent (each difference is against the copy the previous one produced), so the
mixer is ``ordered``: a message that arrives before an older one from the same peer waits for
it; staleness is bounded by tau as before.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvd_sgp.common.arrays import host_view
from hvd_sgp.common.codecs import BLOCK, Codec, blocks
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.pushsum import Part, PushSumMixer, Slot
from hvd_sgp.common.timing import Timing
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport_protocol import Transport

HEADER = 24  # gamma * share, the weight share and the raw flag, as three float64


class ChocoMixer(PushSumMixer):
    """One node's compressed PushSum on one buffer (see the module docstring): the codec part
of a mixer, under either timing part.

    ``step`` is gamma (the codec's ``consensus_step`` when None); ``error_feedback`` chooses
    whether each push encodes the distance to the public copy (what was not sent yet is sent
    later) or only the change since the last push (the codec's error is dropped).

    The shard changes by a linear combination of copies, z' = (w z + sum_t a_t c_t) / w',
    whose terms (-s_ji, c_ij) and (s_ij, c_ji) are collected while the iteration's messages
    are encoded and decoded, and applied in one fused pass when it settles (before a copy in
    a pending term changes again), instead of one pass per term plus re-bias and de-bias.
    """

    def __init__(self, buffer, topology: Topology, transport: Transport,
                 shard: Optional[Callable[[Any], Part]] = None, push_sum: bool = True,
                 codec: Optional[Codec] = None, track_weight: Optional[bool] = None,
                 step: Optional[float] = None, error_feedback: bool = True, *,
                 timing: Optional[Timing] = None, slot: Optional[Slot] = None):
        super().__init__(host_view(buffer), topology, transport, shard, push_sum, codec,
                         track_weight, timing=timing, slot=slot)
        self.step = self.codec.consensus_step if step is None else float(step)
        if not 0 < self.step <= 1:
            raise SgpValueError(f"the consensus step must be in (0, 1], got {self.step!r}")
        self.error_feedback = bool(error_feedback)
        self.sent: dict[int, np.ndarray] = {}  # c_ij: this node's copy as out-peer j holds it
        self.received: dict[int, np.ndarray] = {}  # c_ji: in-peer j's copy, as sent to us
        self.references: dict[int, np.ndarray] = {}  # r_ij without error feedback
        self._opened_out: set[int] = set()  # edges whose first (exact) message was posted
        self._opened_in: set[int] = set()
        self.codec_seconds = 0.0  # encoding, decoding and copy updates (no communication)
        self.ledger: Optional[np.ndarray] = None  # per entry: mass sent - received (tests)
        self._terms: list[tuple[float, np.ndarray]] = []  # (a_t, c_t) not yet applied
        self._base = 1.0  # the weight w that the pending terms start from

    ordered = True  # each difference is against the copy the sender's previous one produced

    def reads_in_place(self) -> bool:
        """Never: a push is an encoding (and the first on an edge a copy) of the shard."""
        return False

    @property
    def shard(self) -> np.ndarray:
        return self.buffer[self.start:self.stop]

    def copies(self) -> int:
        """Shard-sized arrays held for the compressed gossip (the memory it costs)."""
        return len(self.sent) + len(self.received) + len(self.references)

    def _payload(self, raw: bool) -> int:
        size = self.width * self.buffer.itemsize if raw else self.codec.nbytes(self.width)
        return -(-size // 8) * 8  # rows stay 8-byte aligned

    # --- pushing --------------------------------------------------------------------------
    def begin(self, slot=None):
        slot = slot if slot is not None else self.slot
        phase = self.topology.phase(self.iteration)
        out_peers, in_peers = phase.out_peers[self.node], phase.in_peers(self.node)
        shares = phase.out_weights[self.node]
        weight = self.weight
        sends = []
        began = time.perf_counter()
        for t, (peer, share) in enumerate(zip(out_peers, shares)):
            raw = self.codec.exact or peer not in self._opened_out
            message = slot.send(t, HEADER + self._payload(raw), True)
            self._encode(peer, raw, message)
            mass = self.step * share * weight
            message[:HEADER].view(np.float64)[:] = (self.step * share, mass, float(raw))
            sends.append((peer, message))
            self._opened_out.add(peer)
            self._term(-mass, self.sent[peer])
        self.codec_seconds += time.perf_counter() - began
        if self.track_weight:
            self.buffer[self.n] = weight * (1 - self.step * sum(shares))
        sizes = [HEADER + self._payload(self.codec.exact or peer not in self._opened_in)
                 for peer in in_peers]
        self._opened_in.update(in_peers)
        received = slot.receive(len(in_peers), max(sizes, default=HEADER), True)
        pending = self.transport.start(self.iteration, sends,
                                       [(peer, received[t]) for t, peer in enumerate(in_peers)])
        pending.received = received
        return pending

    def _encode(self, peer: int, raw: bool, message: np.ndarray) -> None:
        """Write the push to ``peer`` into ``message`` and update its public copy."""
        z, payload = self.shard, message[HEADER:]
        if raw:
            payload[:self.width * z.itemsize].view(z.dtype)[...] = z
            self._set_copy(self.sent, peer, z)
            if not self.error_feedback:
                _store(self.references, peer, z)
            return
        data = payload[:self.codec.nbytes(self.width)]
        self._settle_terms(self.sent[peer])
        if self.error_feedback:
            self.codec.encode_delta(z, self.sent[peer], data, copy=self.sent[peer],
                                    seed=self.iteration)
        else:
            self.codec.encode_delta(z, self.references[peer], data, copy=self.sent[peer],
                                    seed=self.iteration)
            self.references[peer][...] = z

    # --- receiving ------------------------------------------------------------------------
    def add(self, received, sources: list[int]) -> None:
        """Apply received differences to the copies of their senders, in the order given, and
        add each sender's share of its copy to the numerator; the weight shares to the weight."""
        for row, source in zip(received, sources):
            _, weight, raw = (float(v) for v in row[:HEADER].view(np.float64))
            began = time.perf_counter()
            payload = row[HEADER:]
            if raw:
                values = payload[:self.width * self.buffer.itemsize].view(self.buffer.dtype)
                finite = bool(np.isfinite(values).all())
            else:
                data = payload[:self.codec.nbytes(self.width)]
                finite = self.codec.finite(data, self.width)
            self._check_finite(finite and math.isfinite(weight), source)
            if self.track_weight:
                self._check_weight(weight, float(self.buffer[self.n]), source)
            if raw:
                self._set_copy(self.received, source, values)
            else:
                self._settle_terms(self.received[source])
                self.codec.add_to(data, self.width, self.received[source])
            self.codec_seconds += time.perf_counter() - began
            self._term(weight, self.received[source])
            if self.track_weight:
                self.buffer[self.n] += weight

    def _term(self, coefficient: float, copy: np.ndarray) -> None:
        if not self._terms:
            self._base = self.weight
        self._terms.append((coefficient, copy))
        self._record(coefficient, copy)

    def _set_copy(self, copies: dict, peer: int, values: np.ndarray) -> None:
        """Set a public copy (allocated at an edge's first message, then reused)."""
        if peer in copies:
            self._settle_terms(copies[peer])
        _store(copies, peer, values)

    def _settle_terms(self, changing: Optional[np.ndarray] = None) -> None:
        """Apply the pending terms to the shard in one pass (only when ``changing``, a copy
        about to be written, is among them, where given)."""
        if not self._terms or (changing is not None
                               and all(c is not changing for _, c in self._terms)):
            return
        began = time.perf_counter()
        combine(self.shard, self._base, self._terms, self.weight)
        self._terms = []
        self.codec_seconds += time.perf_counter() - began

    def settle(self) -> None:
        """Apply the iteration's terms (the shard is then de-biased: z = x / w), then end it."""
        self._settle_terms()
        super().settle()

    def abandon(self) -> None:
        self._settle_terms()
        super().abandon()

    def _record(self, coefficient: float, copy: np.ndarray) -> None:
        """Mass ledgers for tests (the weight share times the copy, and the share; sent mass
        is a negative coefficient): totals in ``audit``, per entry in ``ledger``."""
        if self.audit is not None:
            mass = np.array([abs(coefficient) * float(copy.sum(dtype=np.float64)),
                             abs(coefficient)])
            if coefficient < 0:
                self.audit.sent += mass
            else:
                self.audit.received += mass
        if self.ledger is not None:
            self.ledger[:-1] -= coefficient * copy
            self.ledger[-1] -= coefficient

    # --- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict:
        """The public copies (needed to resume exactly); call with nothing in flight."""
        return {"sent": {p: c.copy() for p, c in self.sent.items()},
                "received": {p: c.copy() for p, c in self.received.items()},
                "references": {p: c.copy() for p, c in self.references.items()}}

    def load_state(self, state: dict) -> None:
        for name in ("sent", "received", "references"):
            copies = {int(p): np.array(c, dtype=self.buffer.dtype)
                      for p, c in state.get(name, {}).items()}
            if any(len(c) != self.width for c in copies.values()):
                raise SgpValueError(f"checkpoint's compressed-gossip copies do not fit this "
                                    f"model's shard of {self.width} values")
            setattr(self, name, copies)
        self._opened_out = set(self.sent)
        self._opened_in = set(self.received)


def combine(shard: np.ndarray, weight: float, terms: Sequence[tuple[float, np.ndarray]],
            new_weight: float) -> None:
    """shard = (weight shard + sum_t a_t c_t) / new_weight, block by block: one pass over
    memory, with the weight and de-bias folded in (the numerators are never stored). Terms
    with opposite coefficients (a node's out- and in-copy of one iteration on a regular
    graph) are taken as one difference."""
    scale = weight / new_weight
    pairs, singles, rest = [], [], [(a / new_weight, c) for a, c in terms]
    while rest:
        a, c = rest.pop()
        twin = next((t for t, (b, _) in enumerate(rest) if b == -a), None)
        if twin is None:
            singles.append((a, c))
        else:
            pairs.append((a, c, rest.pop(twin)[1]))
    work = np.empty(min(BLOCK, len(shard)), shard.dtype)
    for start, stop in blocks(len(shard)):
        out, tmp = shard[start:stop], work[:stop - start]
        if scale != 1:
            out *= scale
        for a, plus, minus in pairs:
            np.subtract(plus[start:stop], minus[start:stop], out=tmp)
            tmp *= a
            out += tmp
        for a, copy in singles:
            np.multiply(copy[start:stop], a, out=tmp)
            out += tmp


def _store(copies: dict, peer: int, values: np.ndarray) -> None:
    """Set a public copy (allocated at an edge's first message, then reused)."""
    if peer in copies:
        copies[peer][...] = values
    else:
        copies[peer] = values.copy()
