"""Work inside one node (the ranks that share memory, or ``HVD_SGP_LOCAL_SIZE`` of them): the
shard of the buffer each local rank carries across nodes (a mixer's part, handed to it as
``shard=in_node(local)``), exact averages (consensus over the whole job, optimizer or model
state), and the small agreements an adapter needs among a node's ranks.

SGP gossips between nodes; inside a node everything is exact.
"""
from __future__ import annotations

from itertools import chain, repeat
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvd_sgp.common import place
from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.mpi import MPI


def mpi_type(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a numpy dtype (kits of other array types map to numpy's)."""
    return MPI._typedict[np.dtype(dtype).char]


def mpi_type_of(a: Any) -> MPI.Datatype:
    return mpi_type(kit_for(a).numpy_dtype(a))


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Start and end of shard ``index`` when n elements are cut into ``parts`` near-equal runs."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def average_in_node(array, local: MPI.Comm) -> None:
    """Exact in-place average of one array over the ranks of a node."""
    average_arrays([array], local)


def average_arrays(arrays: Sequence, comm: MPI.Comm) -> None:
    """Exact in-place average of each array over ``comm`` (optimizer state entering AllReduce
    SGD); arrays of any registered kit, through host memory where MPI cannot reach them."""
    if comm.Get_size() == 1:
        return
    for array in arrays:
        with kit_for(array).for_mpi(array) as view:
            comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
            view /= comm.Get_size()


class NodeShard:
    """The run of the buffer this local rank carries across nodes (all of it when the node has
    one rank), and the in-node gather that reassembles the whole buffer afterwards."""

    def __init__(self, buffer, local: Optional[MPI.Comm]):
        self.buffer = buffer
        self.kit = kit_for(buffer)
        n = len(buffer) - 1
        self.local = local if local is not None and local.Get_size() > 1 else None
        parts, index = (self.local.Get_size(), self.local.Get_rank()) if self.local else (1, 0)
        self.start, self.stop = shard_bounds(n, parts, index)
        bounds = [shard_bounds(n, parts, r) for r in range(parts)]
        self._spec = [buffer, [b - a for a, b in bounds], [a for a, _ in bounds],
                      mpi_type_of(buffer)]

    def message(self) -> Any:
        """What one uncompressed push sends in place: the shard and the weight slot (an MPI
        indexed type over the buffer; the buffer itself where the shard is all of it)."""
        n = len(self.buffer) - 1
        if self.start == 0 and self.stop == n:
            return self.buffer
        dtype = self._spec[3].Create_indexed([self.stop - self.start, 1], [self.start, n])
        dtype.Commit()
        return [self.buffer, 1, dtype]

    def gather(self) -> None:
        if self.local is not None:
            self.kit.ready(self.buffer)
            self.local.Allgatherv(MPI.IN_PLACE, self._spec)


def in_node(local: Optional[MPI.Comm]) -> Callable[[Any], NodeShard]:
    """A mixer's ``shard``: each buffer cut into this local rank's shard of ``local``'s node."""
    return lambda buffer: NodeShard(buffer, local)


def exact_average(buffer, cross: MPI.Comm, local: Optional[MPI.Comm],
                  entry_weights: Optional[np.ndarray] = None,
                  scratch: Optional[np.ndarray] = None) -> None:
    """Exact consensus: every node gets sum_i(w_i z_i) / sum_i(w_i), and weight 1.

    Local rank l averages shard l with the same shard of every other node, weighted by its own
    PushSum weight (the one that shard carried: under overlap the local ranks' weights differ),
    or entry by entry by ``entry_weights`` (random-k gossip's per-run weights, on host
    buffers), then the node gathers the shards. Weights of a shard that no longer matches
    (a node lost a rank, and the shards were cut anew) are taken as 1.

    The sums are taken in a copy, and the buffer is written only once every cross-node
    collective has returned. A fold cut short by a lost rank then leaves the buffer as it was,
    and the repair's next attempt folds the same state. Folded in place, the buffer of a fold
    cut short was already multiplied by its weight (or half summed), and the retry folded
    that: the likely cause of a chaos run's divergence (docs/faults.md).

    ``scratch`` (a host buffer's length less its weight slot, pages already touched) holds that
    copy instead of a new array: at 25M parameters and 8 ranks on one host, the fresh copy's
    page faults took 0.4-0.7 s of a repair's fold (``fold_scratch``).
    """
    part = NodeShard(buffer, local)
    shard = buffer[part.start:part.stop]
    room = scratch[:len(shard)] if scratch is not None else None
    if entry_weights is not None and len(entry_weights) == len(shard):
        weights = np.array(entry_weights, dtype=np.float64)
        numerators = room if room is not None else np.empty_like(shard)
        np.multiply(shard, weights, out=numerators, casting="unsafe")
        if cross.Get_size() > 1:
            cross.Allreduce(MPI.IN_PLACE, numerators, op=MPI.SUM)
            cross.Allreduce(MPI.IN_PLACE, weights, op=MPI.SUM)
        np.divide(numerators, weights, out=numerators, casting="unsafe")
    else:
        weight = float(buffer[-1])
        numerators = (np.multiply(shard, weight, out=room) if room is not None
                      else shard * weight)
        weights = np.array([weight])
        if cross.Get_size() > 1:
            part.kit.ready(numerators)
            cross.Allreduce(MPI.IN_PLACE, numerators, op=MPI.SUM)
            cross.Allreduce(MPI.IN_PLACE, weights, op=MPI.SUM)  # (not cross.allreduce: mpi.py)
        numerators /= weights[0]
    shard[...] = numerators
    buffer[-1] = 1
    part.gather()


def fold_scratch(buffers: Sequence, previous: Sequence = ()) -> list:
    """One host array per host buffer for ``exact_average``'s copy (None for a device's
    buffer, whose allocator keeps its memory), its pages touched now: a repair's fold then
    writes memory it already has. One more copy of the model in host memory, kept for
    fault-tolerant mode, where the fold is on the way back from every lost rank. An array of
    ``previous`` (a retired engine's) is taken over where it fits: touching a model's size of
    fresh pages on every survivor at once is most of a successor's start."""
    return [None if not isinstance(buf, np.ndarray) else
            old if (old is not None and old.shape == (len(buf) - 1,) and old.dtype == buf.dtype)
            else _touched(len(buf) - 1, buf.dtype)
            for buf, old in zip(buffers, chain(previous, repeat(None)))]


def _touched(size: int, dtype: Any) -> np.ndarray:
    """A new array whose pages are in memory (np.zeros leaves them to the first write)."""
    array = np.empty(size, dtype=dtype)
    array.fill(0)
    return array


def broadcast_in_node(value: Any) -> Any:
    """Local rank 0's ``value`` on every rank of this node (a rendezvous address, say)."""
    return place.local_comm().bcast(value, root=0)


def gather_by_node(value: Any) -> list[list[Any]]:
    """Every rank's ``value``, grouped by node (cross rank), in local-rank order."""
    entries = place.world_comm().allgather((place.cross_rank(), place.local_rank(), value))
    nodes: list[list[Any]] = [[] for _ in range(place.cross_size())]
    for node, _, v in sorted(entries, key=lambda e: (e[0], e[1])):
        nodes[node].append(v)
    return nodes
