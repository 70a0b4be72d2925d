"""join(): a rank out of data serves its peers, one served step at a time.

While this rank is joined, each served step (schedule, zero gradients where the peers sum
theirs, the exchange of its own parameters and weight) runs on a thread: it blocks in MPI
until the peers take that step, and meanwhile join() must keep serving the negotiated
collectives, and learn when every rank has joined. A step begun then is counted in
``started_iteration``, so every rank's ``finish()`` takes it too. Where a group of ranks
shares one model (a node, or the world in AllReduce mode), the step after a partial sum
re-syncs the joined ranks from the lowest rank that updated, and their optimizer state at the
end of join().

It drives the engine's public step (``begin_step``, ``reduce_gradients``, ``end_step``,
``drain``) and reads its ``buffers``, ``steps``, ``optimizer_state`` and ``transport.timeout``;
it waits with ``engine.wait`` and reaches the parameters with ``engine.live``. The engine asks
it ``serving`` and ``in_node_sum`` when it sums gradients, tells it ``summed_partially`` and
calls ``resync`` before each exchange.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from hvd_sgp.common import place, recovery
from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.waiting import Wait

if TYPE_CHECKING:
    from hvd_sgp.common.engine import GossipEngine


class JoinServing:
    """The join() side of one engine (``engine.join``)."""

    def __init__(self, engine: "GossipEngine"):
        self.engine = weakref.proxy(engine)  # (the engine holds this one: no cycle)
        self.serving = False  # this rank has joined: it contributes nothing to gradients
        self._zeros: list = []  # zero gradient buffers that a joined rank contributes
        self._sum_in_node: Optional[Callable] = None  # the peers' in-node sum (NCCL), reused
        self._joined_group: Optional[MPI.Comm] = None  # some of its ranks served this step
        self._resync_source: Optional[tuple] = None  # (group, rank) that re-synced them
        self._server: Optional[threading.Thread] = None  # the served step in progress
        self._server_failure: Optional[BaseException] = None
        self._serve_target = 0  # the step the joined rank has begun serving

    def started_iteration(self) -> int:
        """Steps this rank has begun (the join protocol's agreement)."""
        return max(self.engine.steps, self._serve_target)

    def serve(self, poll: Callable[[], object]) -> bool:
        """Begin one served step, or report whether the one running has ended (no wait)."""
        if self._server is not None:
            if self._server.is_alive():
                return False
            self._end_served_step()
            return True
        self.serving = True
        self._serve_target = self.engine.steps + 1
        if not place.mpi_threads_supported():  # no MPI from two threads: serve in line
            self._served_step()
            self._end_served_step()
            return True
        self._server = recovery.worker_thread(self._served_step, "hvd_sgp join server")
        self._server.start()
        return True

    def abandon(self) -> None:
        """The world was repaired (fault-tolerant mode): the served step in progress ended
        with the old world (the repair waited for its thread), and its failure is that world's,
        already repaired; raised at the next join() it would start a repair with nobody lost.
        The next join() starts afresh; the training function restarts before it."""
        self._server = self._server_failure = None
        self._joined_group = self._resync_source = None
        self.serving, self._serve_target = False, 0

    def _served_step(self) -> None:
        engine = self.engine
        try:
            plan = engine.begin_step(engine.optimizer_state)
            if plan.reduce:
                if not self._zeros:
                    self._zeros = [kit_for(b).empty(b, (len(b),)) for b in engine.buffers]
                for zeros in self._zeros:
                    zeros[...] = 0
                    engine.reduce_gradients(zeros)
            engine.end_step()
        except BaseException as error:  # noqa: B902 (raised again on join()'s thread)
            self._server_failure = error

    def _end_served_step(self) -> None:
        self._server = None
        failure, self._server_failure = self._server_failure, None
        if failure is not None:
            raise failure

    def finish(self, last: int, poll: Callable[[], object]) -> None:
        """Serve up to iteration ``last`` (agreed by every rank), then drain: every rank
        leaves join() having summed in the same messages. Ranks that served are re-synced
        with the ones that updated where a group shares one model."""
        self.serving = True
        try:
            if self._server is not None:
                server = self._server
                Wait("a served step", lambda: "the peers of this joined rank",
                     self.engine.transport.timeout, self._serve_target).until(
                         lambda: poll() or server.join(1e-3) or not server.is_alive())
                self._end_served_step()
            while self.engine.steps < last:
                self._served_step()
                self._end_served_step()
            self.engine.drain()
        finally:
            self.serving, self._serve_target = False, 0
        if self._resync_source is not None:
            self.engine.live(self._resync_optimizer_state)

    # --- what the engine asks while it sums gradients and exchanges -------------------------
    def in_node_sum(self, given: Optional[Callable]) -> Optional[Callable]:
        """The in-node sum to use: the adapter's ``given`` one (NCCL), which a joined rank,
        given none, reuses so that it sums as its peers do."""
        if self.serving:
            return self._sum_in_node
        self._sum_in_node = given
        return given

    def summed_partially(self, comm: MPI.Comm) -> None:
        """Some ranks of ``comm`` served this step: re-sync them before the exchange."""
        self._joined_group = comm

    def resync(self) -> None:
        """After a step where some ranks of a group had joined: those ranks did not update,
        so the lowest rank that did sends its parameters (which every rank that updated
        shares) to the group, before shards are mixed or gathered."""
        comm = self._joined_group
        if comm is None:
            return
        wait = self.engine.wait
        mine = np.array([comm.Get_size() if self.serving else comm.Get_rank()], np.int64)
        wait(comm.Iallreduce(MPI.IN_PLACE, mine, op=MPI.MIN), "join re-sync", comm)
        self._joined_group, self._resync_source = None, (comm, int(mine[0]))
        for buf in self.engine.buffers:  # not the weight: under Overlap SGP each rank has its own
            with kit_for(buf).for_mpi(buf) as view:
                wait(comm.Ibcast(view[:-1], root=int(mine[0])), "join re-sync", comm)

    def _resync_optimizer_state(self) -> None:
        """At the end of join(): the optimizer state (momentum, moments) of the ranks that
        served is the updating ranks' too (ranks that never stepped have none to receive)."""
        comm, root = self._resync_source
        self._resync_source = None
        arrays = list(self.engine.optimizer_state())
        layouts = comm.allgather([(str(kit_for(a).numpy_dtype(a)), tuple(a.shape))
                                  for a in arrays])
        if any(other != layouts[root] for other in layouts):
            return
        for array in arrays:
            with kit_for(array).for_mpi(array) as view:
                comm.Bcast(view, root=root)
