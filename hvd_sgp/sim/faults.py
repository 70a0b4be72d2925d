"""Lost nodes in the simulator: the repair's PushSum side in one process.

``lose`` does what ``repair.Repair`` does on the survivors of a real failure, with the core's
own pieces. First each mixer abandons its iterations in flight (``abandon``), and every
message in flight is dropped with the old transport. Then the survivors fold into their
exact weighted average (``node.exact_average``, entry by entry for random-k). The fold's
collectives run over ``ThreadGroup``, an in-process communicator of one thread per survivor.
So the fold and the mass ledger can be tested for every n, graph, codec, delay and failure
pattern as property tests, without a launch (tests/test_faults.py).
"""
from __future__ import annotations

import threading
from functools import reduce
from typing import Any, Iterable, Optional, Union

import numpy as np

from hvd_sgp.common.errors import PeerLostError, PeerTimeoutError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.node import exact_average, fold_scratch
from hvd_sgp.common.topology import Topology
from hvd_sgp.sim.network import SimNetwork

DEADLINE_SECONDS = 60.0  # a member that never reaches a collective fails it, never hangs it


class ThreadGroup:
    """``size`` members, one thread each, that meet in sum collectives: every member gets the
    same sum, taken in rank order. ``dies`` = (member, k) makes that member die at its k-th
    collective (counted from 0): it raises PeerLostError there, and so does every other
    member's collective then in progress, as ULFM reports a lost peer."""

    def __init__(self, size: int, dies: Optional[tuple[int, int]] = None):
        self.size = size
        self.dies = dies
        self._calls = [0] * size
        self._barrier = threading.Barrier(size, timeout=DEADLINE_SECONDS)
        self._slots: list[Any] = [None] * size

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def total(self, rank: int, value: Any) -> Any:
        if self.dies == (rank, self._calls[rank]):
            self.abort()
            raise PeerLostError(f"member {rank} died in its collective {self._calls[rank]}")
        self._calls[rank] += 1
        try:
            self._slots[rank] = value
            self._barrier.wait()
            result = reduce(lambda a, b: a + b, self._slots)
            self._barrier.wait()  # everyone has read the slots before any is written again
        except threading.BrokenBarrierError:
            raise PeerLostError(f"member {rank}: a peer was lost in a collective") from None
        return result

    def abort(self) -> None:
        """A member failed: the others' collectives fail too (BrokenBarrierError)."""
        self._barrier.abort()


class ThreadComm:
    """The part of an MPI communicator that the fold uses: ``Get_size``, ``Get_rank``, and
    sum allreduces (in place for arrays)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def Get_size(self) -> int:
        return self.group.size

    def Get_rank(self) -> int:
        return self.rank

    def Allreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = MPI.SUM) -> None:
        if sendbuf is not MPI.IN_PLACE or op is not MPI.SUM:
            raise SgpValueError("ThreadComm.Allreduce sums in place only")
        recvbuf[...] = self.group.total(self.rank, recvbuf.copy())

    def allreduce(self, value: Any, op: Any = MPI.SUM) -> Any:
        if op is not MPI.SUM:
            raise SgpValueError("ThreadComm.allreduce sums only")
        return self.group.total(self.rank, value)


def run_members(group: ThreadGroup, work: list) -> None:
    """Run ``work[r](group.comm(r))`` for every member in a thread of its own; the first
    error of any member is raised here."""
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            work[rank](group.comm(rank))
        except BaseException as error:  # noqa: BLE001 (re-raised below, on the caller's thread)
            errors.append(error)
            group.abort()

    threads = [threading.Thread(target=member, args=(r,), daemon=True)
               for r in range(group.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_SECONDS)
    if errors:
        raise errors[0]
    late = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if late:
        raise PeerTimeoutError(f"members {late} did not finish within {DEADLINE_SECONDS:.0f} s")


def lose(net: SimNetwork, lost: Iterable[int],
         topology: Optional[Union[str, Topology]] = None,
         dies: Optional[tuple[int, int]] = None) -> SimNetwork:
    """The network of the survivors of ``lost`` nodes, after the repair's fold: every survivor
    holds sum_i(w_i z_i) / sum_i(w_i) over the survivors as they stood (entry by entry where
    the mixers keep weights per entry) with weight 1, and nothing is in flight. It mixes over
    ``topology`` (default: the network's own family for the new size) with the same settings.
    ``net`` is spent: its mixers have abandoned their iterations. ``dies`` = (node, k): that
    survivor dies at the fold's k-th collective, which raises PeerLostError (the repair then
    starts over: ``lose`` again, with it lost too)."""
    lost = set(lost)
    survivors = [i for i in range(net.n) if i not in lost]
    if not survivors or not lost <= set(range(net.n)):
        raise SgpValueError(f"lost nodes {sorted(lost)} must be some, not all, of {net.n}")
    if dies is not None and dies[0] not in survivors:
        raise SgpValueError(f"node {dies[0]}, which dies in the fold, is not a survivor")
    for mixer in net.mixers:
        mixer.abandon()
    net.mailbox.messages.clear()  # (the old transport's messages go with it)
    entry_weights = [net.mixers[i].entry_weights() for i in survivors]
    buffers = [net.buffers[i] for i in survivors]
    scratch = fold_scratch(buffers)  # (as an engine's in fault-tolerant mode)
    victim = None if dies is None else (survivors.index(dies[0]), dies[1])
    run_members(ThreadGroup(len(survivors), victim),
                [lambda comm, r=r: exact_average(buffers[r], comm, None, entry_weights[r],
                                                 scratch[r])
                 for r in range(len(survivors))])
    after = SimNetwork(net.topology.name if topology is None else topology, net.dim,
                       n=len(survivors), **net.settings)
    after.buffers[...] = np.stack(buffers)
    return after
