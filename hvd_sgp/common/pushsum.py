"""PushSum mixing on one fused flat buffer.

Layout: ``buffer[:n]`` holds the de-biased parameters z = x / w (what the model reads and the
optimizer updates) and ``buffer[n]`` the PushSum weight w. The numerators x = w z are never
formed: a push sends z itself with its weight share s = p w (the message is the buffer, shard
and weight slot, where no copy is needed), the node keeps w (1 - sum p), and a message (z', s)
is summed in as (w z + s z') / (w + s), one in-place lerp z += s / (w + s) (z' - z). That is
PushSum's update exactly (the numerators w z + s z' and weights w + s are PushSum's), in one
pass per message instead of re-biasing, adding and de-biasing (three). Where every mixing
matrix is doubly stochastic and delivery is synchronous, w returns to 1 after each iteration
and is reset to exactly 1 (``track_weight`` off).

Within a node of L ranks, local rank l carries only shard l of the buffer to local rank l of
the peer nodes (every NIC works), then the node gathers the shards back: the mixer's ``shard``
(node.in_node over the node's communicator) cuts the buffer and gathers it; without one, the
node is one rank and pushes the whole buffer. No MPI here: the transport and the shard carry
it, so the simulator mixes with the same classes in one process.

The buffer is a numpy array, or any array type an adapter registered a kit for (arrays.py):
torch CUDA tensors go to a CUDA-aware MPI without a host copy.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.codecs import WEIGHT_BYTES, Codec, codec as make_codec
from hvd_sgp.common.errors import SgpError, SgpValueError, TopologyError
from hvd_sgp.common.timing import Synchronous, Timing
from hvd_sgp.common.topology import Topology
from hvd_sgp.common.transport_protocol import Pending, Transport


def allocate(n: int, dtype=np.float32) -> np.ndarray:
    """A zeroed buffer for n parameters plus the weight slot, which starts at 1."""
    buf = np.zeros(n + 1, dtype=dtype)
    buf[n] = 1
    return buf


class Part(Protocol):
    """The run ``[start, stop)`` of the buffer this rank pushes, and how the node puts the
    whole buffer back together after an iteration (node.NodeShard, WholeBuffer)."""

    start: int
    stop: int

    def message(self) -> Any:
        """What one uncompressed push sends in place: the run and the weight slot."""

    def gather(self) -> None: ...


class WholeBuffer:
    """The part of a node of one rank: the whole buffer, nothing to gather."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.start, self.stop = 0, len(buffer) - 1

    def message(self) -> Any:
        return self.buffer

    def gather(self) -> None:
        pass


class Slot:
    """Message storage of one iteration: send copies and receive rows, allocated on first use
    and reused by later iterations (the synchronous mixer keeps one; Overlap SGP a ring of
    them), so a step allocates nothing. It outlives its mixer: the mixers built after a
    repair, a restore or replacements joining take it over (``serves``), so the first
    exchange after one writes memory it already has (fresh pages cost a model's size in page
    faults on every rank at once)."""

    def __init__(self, kit, like):
        self.kit, self.like = kit, like
        self.sends: dict[tuple, object] = {}  # by (index, wire)
        self.rows: dict[bool, object] = {}  # by wire

    def serves(self, kit, like) -> bool:
        """Whether this storage holds messages of buffer ``like`` (its kit, dtype, device)."""
        return (kit is self.kit and like.dtype == self.like.dtype
                and getattr(like, "device", None) == getattr(self.like, "device", None))

    def send(self, index: int, size: int, wire: bool):
        out = self.sends.get((index, wire))
        if out is None or len(out) != size:
            out = self.sends[index, wire] = self.kit.empty(self.like, (size,), wire)
        return out

    def receive(self, rows: int, size: int, wire: bool):
        out = self.rows.get(wire)
        if out is None or tuple(out.shape) != (rows, size):
            out = self.rows[wire] = self.kit.empty(self.like, (rows, size), wire)
        return out


class Audit:
    """Mass ledger for tests: what this node pushed and what it summed in, as (numerators,
    weight). Summed over nodes, sent - received is the mass in flight."""

    def __init__(self) -> None:
        self.sent = np.zeros(2)
        self.received = np.zeros(2)


class PushSumMixer:
    """The mixing state of one node; ``transport`` reaches the other nodes (over MPI: the cross
    communicator, one rank per node; in the simulator: in-process mailboxes).

    This class is the codec part of a mixer (what a message carries: here the parameters
    themselves; choco.py and sparse.py carry other things); ``timing`` is its timing part
    (timing.py: synchronous by default, or overlap.Overlap).

    A ``codec`` other than the identity (see codecs.py) encodes the pushed parameters; the
    weight then travels exact beside them, and receivers accumulate in the buffer's precision.
    ``track_weight`` forces the weight on (or off) instead of deciding from the graph and the
    timing (messages summed in late move it: Overlap SGP always tracks it). ``shard`` cuts the
    buffer into this rank's ``Part`` (node.in_node(local) in a node of several ranks; None:
    the whole buffer). ``slot``: message storage left by the mixer this one succeeds, taken
    over where it serves this buffer (see Slot).
    """

    ordered = False  # whether a peer's messages must be summed in in the order sent

    def __init__(self, buffer, topology: Topology, transport: Transport,
                 shard: Optional[Callable[[Any], Part]] = None, push_sum: bool = True,
                 codec: Optional[Codec] = None, track_weight: Optional[bool] = None, *,
                 timing: Optional[Timing] = None, slot: Optional[Slot] = None):
        self.kit = kit_for(buffer)
        if not self.kit.is_flat(buffer) or len(buffer) < 1:
            raise SgpValueError("the PushSum buffer must be one contiguous 1-D array of "
                                "parameters followed by the weight slot (see allocate())")
        if topology.n != transport.size:
            raise TopologyError(f"topology {topology!r} is for {topology.n} nodes, but the "
                                f"transport connects {transport.size}")
        self.buffer = buffer
        self.n = len(buffer) - 1
        self.topology = topology
        self.node = transport.rank
        self.push_sum = push_sum
        timing = Synchronous() if timing is None else timing
        if push_sum and timing.overlapped and track_weight is False:
            raise SgpValueError("Overlap SGP sums messages in late, which moves the PushSum "
                                "weight: it cannot go untracked (track_weight=False)")
        # None: skip the weight where it provably stays 1 (doubly stochastic, synchronous).
        self.track_weight = push_sum and (not topology.doubly_stochastic or timing.overlapped
                                          if track_weight is None else track_weight)
        self.codec = make_codec(codec)
        self.iteration = 0
        self.transport = transport
        self.part = WholeBuffer(buffer) if shard is None else shard(buffer)
        self.start, self.stop = self.part.start, self.part.stop
        self._wire = not self.codec.exact
        self._message = self._message_spec()
        self.audit: Optional[Audit] = None
        self._size = (self.codec.nbytes(self.width) + WEIGHT_BYTES if self._wire
                      else self.width + 1)
        # synchronous iterations reuse one; a predecessor's where it serves this buffer
        self.slot = (slot if slot is not None and slot.serves(self.kit, buffer)
                     else Slot(self.kit, buffer))
        self.timing = timing
        timing.attach(self)

    @property
    def weight(self) -> float:
        """The PushSum weight (1 where it is not tracked)."""
        return float(self.buffer[self.n]) if self.track_weight else 1.0

    @weight.setter
    def weight(self, value: float) -> None:
        self.buffer[self.n] = value

    @property
    def width(self) -> int:
        return self.stop - self.start

    def _message_spec(self):
        """What one uncompressed push sends in place: the shard and the weight slot."""
        if self._wire:
            return self.buffer[self.start:self.stop]
        return self.part.message()

    @property
    def overlapped(self) -> bool:
        """Whether messages stay in flight between iterations (the timing part says)."""
        return self.timing.overlapped

    @property
    def in_flight(self):
        """The iterations still in flight, oldest first."""
        return self.timing.in_flight

    def reads_in_place(self) -> bool:
        """Whether a push can read the buffer itself (as it is after the local step) instead
        of a copy: uncompressed PushSum pushes do."""
        return not self._wire and self.push_sum

    def mix(self) -> None:
        """One PushSum iteration over this iteration's graph, at the timing part's pace."""
        self.timing.mix()

    def drain(self) -> None:
        """Sum in every message still in flight (for evaluation, checkpoints, mode switches)."""
        self.timing.drain()

    def begin(self, slot: Optional[Slot] = None, in_place: bool = False) -> Pending:
        """Keep this node's share of the weight and post the pushes and receives of the
        current iteration.

        Pushes read the buffer itself where they can (``finish`` completes them before the
        next local step). With a ``slot`` (Overlap SGP) they are copies in it instead, so the
        next local steps can run while they are in flight; the slot stays untouched until the
        returned requests complete; ``in_place`` (Overlap SGP, tau = 1) keeps only the receive
        rows in the slot, and the buffer must then stay untouched until the sends complete.
        """
        copies = slot is not None and not in_place
        slot = slot if slot is not None else self.slot
        phase = self.topology.phase(self.iteration)
        out_peers, in_peers = phase.out_peers[self.node], phase.in_peers(self.node)
        shares = phase.out_weights[self.node]
        shard = self.buffer[self.start:self.stop]
        weight = float(self.buffer[self.n])
        keep = phase.self_weights[self.node]
        self.buffer[self.n] = weight * keep
        if out_peers and phase.uniform_out(self.node):  # one message serves every out-peer
            in_place = not (copies or self._wire) and shares[0] == keep
            message = self._message if in_place else self._copy(slot, 0, shard,
                                                                weight * shares[0])
            sends = [(peer, message) for peer in out_peers]
        else:
            sends = [(peer, self._copy(slot, t, shard, weight * share))
                     for t, (peer, share) in enumerate(zip(out_peers, shares))]
        received = slot.receive(len(in_peers), self._size, self._wire)
        self.kit.ready(self.buffer)
        pending = self.transport.start(self.iteration, sends,
                                       [(peer, received[t]) for t, peer in enumerate(in_peers)])
        pending.received = received
        if self.audit is not None:
            for _, message in sends:
                self.audit.sent += self._mass(message)
        return pending

    def _copy(self, slot: Slot, index: int, shard, share: float):
        """Message ``index`` of this iteration written into ``slot``: the shard (encoded when
        a codec is set) and its weight share."""
        out = slot.send(index, self._size, self._wire)
        if self._wire:
            self.kit.pack(self.codec, shard, share, out)
            return out
        out[:self.width] = shard
        out[self.width] = share
        return out

    def finish(self, pending: Pending) -> None:
        """Wait for this iteration's messages, sum them in and de-bias."""
        self.transport.wait(pending)
        self.add(pending.received, pending.sources())
        self.iteration += 1
        self.settle()

    def settle(self) -> None:
        """End the iteration: an untracked weight back to exactly 1, and the node's shards
        gathered back into the whole buffer. The ablation without PushSum (``push_sum``
        off) keeps the sums un-normalized, as mixing numerators without the weight does."""
        if not self.track_weight:
            if not self.push_sum:
                shard = self.buffer[self.start:self.stop]
                shard *= self.buffer[self.n]
            self.buffer[self.n] = 1
        self.part.gather()

    def release(self) -> None:
        """Wait until no push in flight reads the buffer in place (before it is written)."""
        self.timing.release()

    def absorb(self) -> None:
        """Before the local step: sum in what an in-place push kept out of the buffer."""
        self.timing.absorb()

    def abandon(self) -> None:
        """Give up the iterations in flight (a peer was lost): the shard is de-biased as it
        stands (it always is); the messages in flight, sent or expected, are never added."""
        if not self.track_weight:
            self.buffer[self.n] = 1
        self.timing.abandon()

    def add(self, received, sources: list[int]) -> None:
        """Sum received messages (one row each: parameters z' and weight share s) into the
        shard, each as z += s / (w + s) (z' - z), w += s."""
        shard = self.buffer[self.start:self.stop]
        weight = float(self.buffer[self.n])
        for row, source in zip(received, sources):
            if not self._wire:
                values, share = row[:self.width], float(row[self.width])
            else:
                values, share = self.kit.unpack(self.codec, row, self.width)
            self._check_weight(share, weight, source)
            self._check_finite(self.kit.finite(self._checked(values)), source)
            weight += share
            self.kit.lerp(shard, values, share / weight)
            if self.audit is not None:
                self.audit.received += self._mass(row)
        self.buffer[self.n] = weight

    # The NaN check of a received message reads SAMPLE evenly spaced values on most iterations
    # and all of them every FULL_CHECK_EVERY iterations: a diverged peer's parameters are NaN
    # everywhere within a step (a NaN parameter makes the loss, so every gradient, NaN), so the
    # sample names it at once; an isolated NaN is named at the next full check at the latest.
    SAMPLE = 4096
    FULL_CHECK_EVERY = 64

    def _checked(self, values):
        if len(values) <= 16 * self.SAMPLE or self.iteration % self.FULL_CHECK_EVERY == 0:
            return values
        return values[::len(values) // self.SAMPLE]

    def _mass(self, message) -> np.ndarray:
        """(sum of numerators, weight) carried by one message, for the audit: share x z."""
        if isinstance(message, list):  # [buffer, 1, indexed datatype]: the live shard + weight
            message = self.kit.concat([self.buffer[self.start:self.stop], self.buffer[self.n:]])
        if self._wire:
            values, share = self.kit.unpack(self.codec, message, self.width)
        else:
            values, share = message[:self.width], float(message[self.width])
        return np.array([share * self.kit.total(values), share])

    def state(self) -> dict:
        """What a checkpoint needs beyond the buffer (compressed gossip's copies, random-k's
        run weights); call with nothing in flight."""
        return {}

    def entry_weights(self) -> Optional[np.ndarray]:
        """Each shard entry's PushSum weight where a mixer keeps one per entry (random-k
        gossip where weights move, sparse.py); None: the buffer's weight slot is every
        entry's."""
        return None

    def reset_weights(self) -> None:
        """After an exact average that folded ``entry_weights`` in: every weight is 1."""

    def load_state(self, state: dict) -> None:
        """Restore what ``state`` returned."""

    def _check_finite(self, finite: bool, peer: int) -> None:
        """Name the peer whose message held NaN or infinity: that rank diverged."""
        if not finite:
            raise SgpError(f"received NaN or infinite parameters from "
                           f"{self.transport.peer_name(peer)} at iteration "
                           f"{self.iteration}: that rank diverged")

    def _check_weight(self, share: float, own: float, peer: int) -> None:
        if not math.isfinite(share) or share <= 0:
            raise SgpError(f"received PushSum weight {share!r} from "
                           f"{self.transport.peer_name(peer)} at "
                           f"iteration {self.iteration}: the sender diverged (NaN/inf)")
        if not math.isfinite(own) or own <= 0:
            raise SgpError(f"own PushSum weight is {own!r} at iteration {self.iteration}")


def exchange(mixers: Sequence[PushSumMixer]) -> None:
    """One iteration of every mixer (one per buffer, or per simulated node): synchronous ones
    post all their messages before any waits, so several buffers' pushes travel together;
    overlapped ones each post theirs and sum in what has arrived."""
    if mixers and mixers[0].overlapped:
        for mixer in mixers:
            mixer.mix()
        return
    pending = [mixer.begin() for mixer in mixers]
    for mixer, p in zip(mixers, pending):
        mixer.finish(p)


def release(mixers: Sequence[PushSumMixer]) -> None:
    """Wait until no push in flight reads a buffer in place: call before writing them."""
    for mixer in mixers:
        mixer.release()


def absorb(mixers: Sequence[PushSumMixer]) -> None:
    """Before the local step: sum in what in-place pushes kept out of the buffers while they
    read it (Overlap SGP, tau = 1; see overlap.py)."""
    for mixer in mixers:
        mixer.absorb()


def drain(mixers: Sequence[PushSumMixer]) -> None:
    """Sum in every message still in flight (only Overlap SGP leaves any between steps)."""
    for mixer in mixers:
        mixer.drain()
