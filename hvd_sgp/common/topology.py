"""Directed, time-varying communication graphs.

A topology answers, for node i at iteration k: to whom does i push, with which weights, and from
whom does i receive. Graphs repeat with a finite ``period`` so that each phase's MPI
communicator can be built once. Weights are column-stochastic: node i keeps ``self_weight`` of
its mass and sends ``out_weights[j]`` to out-peer j; they sum to 1. A node needs only its own
out-weights; receivers add whatever arrives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence, Union

import numpy as np

from hvd_sgp.common.errors import TopologyError

# A phase: out-peer lists, or an n-by-n matrix whose entry [i][j] is what i sends to j.
PhaseSpec = Union[Sequence[Sequence[int]], np.ndarray]


@dataclass(frozen=True)
class Phase:
    """One iteration's graph, for every node: out-peers, their weights and the self-weights."""

    out_peers: tuple[tuple[int, ...], ...]
    out_weights: tuple[tuple[float, ...], ...]
    self_weights: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.out_peers)

    @cached_property
    def _in_table(self) -> tuple[tuple[int, ...], ...]:
        table: list[list[int]] = [[] for _ in range(self.n)]
        for j, peers in enumerate(self.out_peers):
            for i in peers:
                table[i].append(j)
        return tuple(map(tuple, table))

    def in_peers(self, i: int) -> tuple[int, ...]:
        """Who pushes to node i, in ascending order (built once per phase)."""
        return self._in_table[i]

    def in_weight(self, i: int) -> float:
        """Node i's row sum of the mixing matrix: 1 for every i means doubly stochastic."""
        return self.self_weights[i] + sum(
            self.out_weights[j][self.out_peers[j].index(i)] for j in self.in_peers(i))

    def matrix(self) -> np.ndarray:
        """The mixing matrix P with P[j, i] = weight of i's mass sent to j (columns sum to 1)."""
        p = np.diag(np.asarray(self.self_weights, dtype=np.float64))
        for i, (peers, weights) in enumerate(zip(self.out_peers, self.out_weights)):
            for j, w in zip(peers, weights):
                p[j, i] += w
        return p

    def uniform_out(self, i: int) -> bool:
        """All of node i's out-peers get the same share (one message serves them all)."""
        return len(set(self.out_weights[i])) <= 1


def _uniform_phase(out_peers: Sequence[Sequence[int]]) -> Phase:
    peers = tuple(tuple(p) for p in out_peers)
    weights = tuple(tuple(1.0 / (len(p) + 1) for _ in p) for p in peers)
    return Phase(peers, weights, tuple(1.0 / (len(p) + 1) for p in peers))


class Topology:
    """A periodic sequence of phases over ``n`` nodes, validated at construction."""

    name = "custom"

    def __init__(self, n: int, phases: Sequence[Phase]):
        if n < 1:
            raise TopologyError(f"a topology needs at least one node, got n={n}")
        self.n = n
        self.phases = tuple(phases)
        if not self.phases:
            raise TopologyError(f"{self.name} topology has no phases")
        for k, phase in enumerate(self.phases):
            _validate_phase(self.name, n, k, phase)
        _validate_connected(self.name, n, self.phases)
        self.doubly_stochastic = all(abs(ph.in_weight(i) - 1.0) <= 1e-12
                                     for ph in self.phases for i in range(n))

    @property
    def period(self) -> int:
        return len(self.phases)

    def phase(self, k: int) -> Phase:
        return self.phases[k % len(self.phases)]

    def out_peers(self, i: int, k: int) -> tuple[int, ...]:
        return self.phase(k).out_peers[i]

    def in_peers(self, i: int, k: int) -> tuple[int, ...]:
        return self.phase(k).in_peers(i)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, period={self.period})"


def _validate_phase(name: str, n: int, k: int, phase: Phase) -> None:
    if phase.n != n:
        raise TopologyError(f"{name} topology phase {k} describes {phase.n} nodes, expected {n}")
    for i in range(n):
        peers, weights = phase.out_peers[i], phase.out_weights[i]
        if len(peers) != len(weights):
            raise TopologyError(f"{name} topology phase {k}: node {i} has {len(peers)} peers "
                                f"but {len(weights)} weights")
        for j in peers:
            if not isinstance(j, (int, np.integer)) or not 0 <= j < n:
                raise TopologyError(f"{name} topology phase {k}: node {i} names peer {j!r}, "
                                    f"out of range 0..{n - 1}")
            if j == i:
                raise TopologyError(f"{name} topology phase {k}: node {i} lists itself as a "
                                    "peer; its own share is the self-weight")
        if len(set(peers)) != len(peers):
            raise TopologyError(f"{name} topology phase {k}: node {i} lists a peer twice: {peers}")
        total = phase.self_weights[i] + sum(weights)
        if min((phase.self_weights[i], *weights)) <= 0 or not math.isclose(total, 1.0, abs_tol=1e-9):
            raise TopologyError(f"{name} topology phase {k}: node {i}'s weights must be positive "
                                f"and sum to 1 (column-stochastic), got {total!r}")


def _validate_connected(name: str, n: int, phases: Sequence[Phase]) -> None:
    """The union of the graphs over one period must be strongly connected: every node reached
    from node 0 along the edges and against them (a search linear in the edges)."""
    tails = np.array([i for ph in phases for i, peers in enumerate(ph.out_peers) for _ in peers],
                     dtype=np.int64)
    heads = np.array([j for ph in phases for peers in ph.out_peers for j in peers],
                     dtype=np.int64)
    for src, dst, forward in ((tails, heads, True), (heads, tails, False)):
        seen = np.zeros(n, dtype=bool)
        seen[0] = True
        while True:
            new = dst[seen[src] & ~seen[dst]]
            if new.size == 0:
                break
            seen[new] = True
        if not seen.all():
            other = int(np.argmin(seen))
            i, j = (0, other) if forward else (other, 0)
            raise TopologyError(f"{name} topology is not strongly connected over its period of "
                                f"{len(phases)}: node {i} never reaches node {j}")


def exponential_offsets(n: int) -> list[int]:
    """Offsets 2^0 .. 2^(m-1) with m = floor(log2(n - 1)) + 1: the paper's exponential graph."""
    if n <= 1:
        return []
    return [2**j for j in range(int(math.floor(math.log2(n - 1))) + 1)]


class ExponentialGraph(Topology):
    """Directed exponential graph: at iteration k, node i pushes to i + 2^(k mod m) (one peer),
    or to the next ``peers`` offsets in the cycle. With n = 2^m and one peer, every node holds
    the exact average after m iterations."""

    name = "exponential"

    def __init__(self, n: int, peers: int = 1):
        _check_peers(self.name, peers)
        offsets = exponential_offsets(n)
        m = max(1, len(offsets))
        used = min(peers, len(offsets))
        phases = [
            _uniform_phase([[(i + offsets[(k + t) % len(offsets)]) % n for t in range(used)]
                            for i in range(n)])
            for k in range(m)
        ] if offsets else [_uniform_phase([[]])]
        super().__init__(n, phases)


class RingGraph(Topology):
    """Directed ring: node i pushes to i+1, ..., i+peers."""

    name = "ring"

    def __init__(self, n: int, peers: int = 1):
        _check_peers(self.name, peers)
        used = min(peers, n - 1)
        super().__init__(n, [_uniform_phase([[(i + t) % n for t in range(1, used + 1)]
                                             for i in range(n)])])


class BipartiteExponentialGraph(Topology):
    """Symmetric pairs for D-PSGD: at phase p, even node i and odd node i + (2^(p+1) - 1) swap
    halves. Every phase is a perfect matching, so mixing is doubly stochastic and weights stay 1."""

    name = "bipartite"

    def __init__(self, n: int, peers: int = 1):
        _check_peers(self.name, peers)
        if n > 1 and n % 2:
            raise TopologyError(f"bipartite topology needs an even number of nodes, got {n}")
        offsets = [2 ** (p + 1) - 1 for p in range(n.bit_length()) if 2 ** (p + 1) - 1 < n]
        if not offsets:
            super().__init__(n, [_uniform_phase([[] for _ in range(n)])])
            return
        phases = [
            _uniform_phase([[(i + o) % n if i % 2 == 0 else (i - o) % n] for i in range(n)])
            for o in offsets
        ]
        super().__init__(n, phases)


class CompleteGraph(Topology):
    """Everyone pushes to everyone with weight 1/n: one step is an exact average (AllReduce)."""

    name = "complete"

    def __init__(self, n: int, peers: int = 1):
        super().__init__(n, [_uniform_phase([[j for j in range(n) if j != i] for i in range(n)])])


class RandomGraph(Topology):
    """Each node pushes to ``peers`` distinct random nodes; ``period`` graphs drawn from ``seed``
    (the same on every rank) repeat, so every rank agrees on everyone's in-peers."""

    name = "random"

    def __init__(self, n: int, peers: int = 1, seed: int = 0, period: int = 16):
        _check_peers(self.name, peers)
        rng = np.random.default_rng(seed)
        used = min(peers, n - 1)
        phases = []
        for _ in range(period):
            # offsets 1..n-1 from each node, redrawn where a node drew one twice
            offsets = rng.integers(1, n, size=(n, used)) if n > 1 else np.zeros((n, 0), int)
            for i in range(n):
                while len(set(offsets[i])) < used:  # dense draws: sample without replacement
                    offsets[i] = (rng.choice(np.arange(1, n), size=used, replace=False)
                                  if 2 * used > n else rng.integers(1, n, size=used))
            phases.append(_uniform_phase([sorted(int((i + o) % n) for o in offsets[i])
                                          for i in range(n)]))
        super().__init__(n, phases)


class CustomGraph(Topology):
    """A user-defined graph: a list of phases, or a callable ``k -> phase`` with a period.

    A phase is a list of out-peer lists (uniform weights 1/(out_degree + 1)), a boolean numpy
    adjacency matrix (likewise uniform), or a float numpy matrix W with W[i][j] the share i sends
    to j (W[i][i] the share it keeps; each row sums to 1).
    """

    name = "custom"

    def __init__(self, n: int, phases: Union[Sequence[PhaseSpec], Callable[[int], PhaseSpec]],
                 period: Optional[int] = None):
        if callable(phases):
            if not period or period < 1:
                raise TopologyError("a callable custom topology needs period >= 1")
            specs = [phases(k) for k in range(period)]
        else:
            specs = list(phases)
        super().__init__(n, [_phase_from_spec(n, k, s) for k, s in enumerate(specs)])


def _phase_from_spec(n: int, k: int, spec: PhaseSpec) -> Phase:
    if isinstance(spec, np.ndarray):
        w = np.asarray(spec, dtype=np.float64)
        if w.shape != (n, n):
            raise TopologyError(f"custom topology phase {k}: matrix shape {w.shape}, "
                                f"expected {(n, n)}")
        if spec.dtype == bool:
            return _uniform_phase([[j for j in range(n) if j != i and w[i, j]] for i in range(n)])
        peers = tuple(tuple(j for j in range(n) if j != i and w[i, j] != 0) for i in range(n))
        return Phase(peers, tuple(tuple(float(w[i, j]) for j in peers[i]) for i in range(n)),
                     tuple(float(w[i, i]) for i in range(n)))
    if len(spec) != n:
        raise TopologyError(f"custom topology phase {k} lists {len(spec)} nodes, expected {n}")
    return _uniform_phase([list(p) for p in spec])


def _check_peers(name: str, peers: int) -> None:
    if not isinstance(peers, (int, np.integer)) or peers < 1:
        raise TopologyError(f"{name} topology needs peers >= 1, got {peers!r}")


TOPOLOGIES: dict[str, type[Topology]] = {
    "exponential": ExponentialGraph,
    "ring": RingGraph,
    "bipartite": BipartiteExponentialGraph,
    "complete": CompleteGraph,
    "random": RandomGraph,
}


def make_topology(spec: Union[str, Topology], n: int, peers: int = 1) -> Topology:
    """A topology from a name (see TOPOLOGIES) or a ready object, checked against n nodes."""
    if isinstance(spec, Topology):
        if spec.n != n:
            raise TopologyError(f"topology {spec!r} is for {spec.n} nodes, but there are {n}")
        return spec
    if not isinstance(spec, str) or spec.lower() not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {spec!r}; choose one of {sorted(TOPOLOGIES)} "
                            "or pass a Topology object")
    return TOPOLOGIES[spec.lower()](n, peers=peers)
