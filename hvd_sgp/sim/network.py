"""A simulated network in one process: the core's PushSum and Overlap mixers, one per node,
exchanging messages through shared in-process mailboxes instead of MPI.

Only the transport and the progress engine are replaced; topology, mixing, de-bias and the
codecs (compressed PushSum for the lossy ones, choco.py) are the core's own code, so what the
simulator shows is what the MPI path computes. Time is counted in
steps: a message posted at step k with delay d arrives at step k + d. Synchronous SGP (delay 0)
delivers within the step; Overlap SGP draws d uniformly from 1..tau (never 0, so the result does
not depend on the order in which nodes run within a step).
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np

from hvd_sgp.common.choco import ChocoMixer
from hvd_sgp.common.codecs import Codec, codec as make_codec, unpack
from hvd_sgp.common.errors import PeerTimeoutError, SgpError, SgpValueError
from hvd_sgp.common.mixers import build
from hvd_sgp.common.pushsum import PushSumMixer, drain, exchange
from hvd_sgp.common.sparse import SparseMixer
from hvd_sgp.common.topology import Topology, make_topology
from hvd_sgp.common.transport_protocol import Pending, TransportStats

Key = tuple[int, int, int]  # (source, destination, iteration)


class Request(NamedTuple):
    """One entry of ``Pending.requests``: a receive into ``row``, or a send arriving at ``due``."""

    key: Key
    row: Optional[np.ndarray]
    due: Optional[int]


class Mailbox:
    """Every message in flight on the simulated network, keyed by (source, destination,
    iteration), with the step at which it arrives."""

    def __init__(self, delay: int = 0, seed: int = 0):
        if delay < 0:
            raise SgpValueError(f"delay must be >= 0 steps, got {delay}")
        self.delay = delay
        self.clock = 0
        self.messages: dict[Key, tuple[int, np.ndarray]] = {}
        self._rng = np.random.default_rng(seed)

    def post(self, key: Key, data: np.ndarray) -> int:
        """Store a message and return its arrival step."""
        if key in self.messages:
            raise SgpError(f"node {key[0]} pushed twice to node {key[1]} at iteration {key[2]}")
        due = key[2] + (int(self._rng.integers(1, self.delay + 1)) if self.delay else 0)
        self.messages[key] = (due, data)
        return due

    def arrived(self, key: Key) -> bool:
        entry = self.messages.get(key)
        return entry is not None and entry[0] <= self.clock

    def deliver(self, key: Key, row: np.ndarray) -> None:
        """Move a message into its receive buffer; a message never sent cannot be waited for in
        one process, so that is an error rather than a hang."""
        entry = self.messages.pop(key, None)
        if entry is None:
            raise PeerTimeoutError(f"node {key[1]} waits for node {key[0]}'s push of iteration "
                                   f"{key[2]}, which was never sent (nodes out of step?)")
        row[:len(entry[1])] = entry[1]  # a compressed push may be shorter than its row


class SimTransport:
    """The Transport protocol for simulated node ``rank``: sends are copied into the
    mailbox (MPI may read a send buffer any time before the wait), a wait delivers receives."""

    def __init__(self, mailbox: Mailbox, rank: int, size: int, timeout: float = 0.0):
        self.mailbox = mailbox
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.stats = TransportStats()

    def start(self, iteration: int, sends: Sequence[tuple[int, Any]],
              receives: Sequence[tuple[int, Any]]) -> Pending:
        pending = Pending(iteration)
        for peer, row in receives:
            pending.requests.append(Request((peer, self.rank, iteration), row, None))
            pending.peers.append(peer)
            pending.kinds.append("receive")
        copies: dict[int, np.ndarray] = {}  # one copy serves every peer of a shared message
        for peer, message in sends:
            data = copies.setdefault(id(message), np.array(message))
            key = (self.rank, peer, iteration)
            pending.requests.append(Request(key, None, self.mailbox.post(key, data)))
            pending.peers.append(peer)
            pending.kinds.append("send")
            self.stats.bytes_sent += data.nbytes
            self.stats.messages_sent += 1
        return pending

    def wait(self, pending: Pending) -> None:
        for request in pending.requests:
            if request.row is not None:
                self.mailbox.deliver(request.key, request.row)

    def peer_name(self, peer: int) -> str:
        return f"node {peer}"

    def free(self) -> None:
        """Nothing to release: the mailbox belongs to the network."""


class SimProgress:
    """The ProgressEngine protocol in simulated time: ``advance()`` moves the clock one step and
    completes what has arrived; a wait delivers at once (the node blocks until arrival)."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox
        self._active: list[Pending] = []  # until every request completed and row summed in

    def submit(self, pending: Pending) -> None:
        pending.complete = [False] * len(pending.requests)
        self._active.append(pending)

    def advance(self) -> None:
        self.mailbox.clock += 1
        clock = self.mailbox.clock
        for pending in self._active:
            for t, request in enumerate(pending.requests):
                if pending.complete[t]:
                    continue
                if request.row is None:
                    pending.complete[t] = request.due <= clock
                elif self.mailbox.arrived(request.key):
                    self.mailbox.deliver(request.key, request.row)
                    pending.complete[t] = True
        self._active = [p for p in self._active
                        if not (all(p.complete) and len(p.added) == len(p.sources()))]

    def wait_receives(self, pending: Pending) -> None:
        for t, request in enumerate(pending.requests):
            if request.row is not None and not pending.complete[t]:
                self.mailbox.deliver(request.key, request.row)
                pending.complete[t] = True

    def wait_sends(self, pending: Pending) -> None:
        """The mailbox copied every send when it was posted: none reads the sender's buffer."""
        pending.complete = [done or request.row is None
                            for done, request in zip(pending.complete, pending.requests)]

    def wait_all(self, pending: Pending) -> None:
        self.wait_receives(pending)
        pending.complete = [True] * len(pending.requests)

    def close(self) -> None:
        """No thread to stop."""

    def unsummed(self) -> Iterator[np.ndarray]:
        """Rows that have arrived but that their node has not yet summed in."""
        for pending in self._active:
            for t, request in enumerate(pending.requests):
                if request.row is not None and pending.complete[t] and t not in pending.added:
                    yield request.row


class SimNetwork:
    """n simulated nodes mixing a ``dim``-vector each by SGP (``delay`` 0) or Overlap SGP with
    delays of 1..``delay`` steps; ``debias=False`` is the ablation without the PushSum weight.

    ``params`` is an (n, dim) view of every node's de-biased parameters z_i: local steps write
    into it, and every node's mixer works on its own row of the same array.

    ``codec`` encodes the pushes: int8 and topk:F through compressed PushSum with
    ``consensus_step`` and ``error_feedback``, randomk:F through exact gossip on shared
    entries (mixers.py decides; ``compressed=True`` forces compressed PushSum for any codec,
    ``False`` pushes encodings naively: the drift it causes).
    """

    def __init__(self, topology: Union[str, Topology], dim: int, n: Optional[int] = None,
                 peers: int = 1, delay: int = 0, debias: bool = True, seed: int = 0,
                 dtype=np.float64, codec: "str | Codec" = "none",
                 compressed: Optional[bool] = None, consensus_step: Optional[float] = None,
                 error_feedback: bool = True):
        if isinstance(topology, str) and n is None:
            raise SgpValueError("a topology given by name needs the number of nodes n")
        topology = make_topology(topology, topology.n if n is None else n, peers)
        self.topology = topology
        self.n = topology.n
        self.settings = dict(peers=peers, delay=delay, debias=debias, seed=seed, dtype=dtype,
                             codec=codec, compressed=compressed, consensus_step=consensus_step,
                             error_feedback=error_feedback)  # (faults.lose builds the survivors')
        self.dim = dim
        self.delay = delay
        self.buffers = np.zeros((self.n, dim + 1), dtype=dtype)  # row i: z_i, then w_i
        self.buffers[:, dim] = 1
        self.params = self.buffers[:, :dim]
        self.mailbox = Mailbox(delay, seed)
        transports = [SimTransport(self.mailbox, i, self.n) for i in range(self.n)]
        self.progress: Optional[SimProgress] = None
        self.codec = make_codec(codec)
        if delay:
            self.progress = SimProgress(self.mailbox)
        self.mixers: list[PushSumMixer] = [
            build(self.buffers[i], topology, transports[i], push_sum=debias, codec=self.codec,
                  progress=self.progress, max_delay=delay, consensus_step=consensus_step,
                  error_feedback=error_feedback, compressed=compressed)
            for i in range(self.n)]
        self.compressed = isinstance(self.mixers[0], ChocoMixer)
        if self.compressed:
            for mixer in self.mixers:
                mixer.ledger = np.zeros(dim + 1)

    @property
    def iteration(self) -> int:
        return self.mixers[0].iteration

    def step(self) -> None:
        """One mixing iteration on every node."""
        exchange(self.mixers)
        if self.progress is not None:
            self.progress.advance()
            return
        if self.mailbox.messages:
            raise SgpError(f"{len(self.mailbox.messages)} pushes of iteration "
                           f"{self.iteration - 1} were never received")

    def drain(self) -> None:
        """Sum in everything still in flight (Overlap SGP); afterwards nothing is in flight."""
        drain(self.mixers)

    def bytes_sent(self) -> int:
        """Bytes every node pushed so far, as the transports counted them."""
        return sum(m.transport.stats.bytes_sent for m in self.mixers)

    def weights(self) -> np.ndarray:
        """Every node's PushSum weight w_i (1 where the mixer does not track it), or (n, dim)
        weights entry by entry where the mixers keep them so (random-k gossip)."""
        if self.mixers[0].entry_weights() is not None:
            return np.stack([m.entry_weights() for m in self.mixers])
        if self.mixers[0].track_weight:
            return self.buffers[:, self.dim].copy()
        return np.ones(self.n, dtype=self.buffers.dtype)

    def in_flight(self) -> tuple[np.ndarray, "float | np.ndarray"]:
        """Numerators and weight pushed but not yet summed in: in the mailbox, or arrived and
        waiting for their node's next step (compressed pushes: from the mixers' ledgers;
        random-k: weights entry by entry)."""
        if self.compressed:
            flow = sum(m.ledger for m in self.mixers)
            return flow[:-1], float(flow[-1])
        rows = [data for _, data in self.mailbox.messages.values()]
        if self.progress is not None:
            rows.extend(self.progress.unsummed())
        numerators = np.zeros(self.dim)
        weight = 0.0
        for row in rows:  # a push carries parameters z and a weight share s: mass s z
            if isinstance(self.mixers[0], SparseMixer):
                carried, shares = self.mixers[0].carried(row)
                numerators += carried
                weight = weight + shares
                continue
            if self.codec.exact:
                values, share = row[:self.dim], float(row[self.dim])
            else:
                values, share = unpack(self.codec, row, self.dim)
            numerators += share * values
            weight += share
        return numerators, weight

    def mass(self) -> tuple[np.ndarray, "float | np.ndarray"]:
        """Sum over nodes of the numerators x_i = w_i z_i and of the weights, plus in flight:
        invariant under mixing."""
        w = self.weights()
        numerators, weight = self.in_flight()
        if w.ndim == 2:  # entry by entry
            return (w * self.params).sum(axis=0) + numerators, w.sum(axis=0) + weight
        return (w[:, None] * self.params).sum(axis=0) + numerators, float(w.sum()) + weight

    def average(self) -> np.ndarray:
        """What exact averaging would hold: the network's numerators, in flight included, / n."""
        return self.mass()[0] / self.n
