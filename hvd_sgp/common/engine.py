"""The framework-free SGP driver behind every DistributedOptimizer.

An adapter hands it flat buffers (one per dtype: parameters + weight slot, see
pushsum.allocate; numpy, or device tensors of a registered kit, see arrays.py) and drives each
step explicitly:

    plan = engine.begin_step(optimizer_state)   # schedule switch, if one is due
    if plan.reduce: engine.reduce_gradients(flat_grads)   # pre-scaled by 1 / plan.ranks
    ...the adapter's local optimizer step...
    engine.end_step(lr)                         # this stage's exchange

begin_step may be left out by an adapter that has no gradients to reduce: end_step then
begins the step itself (see there).

Gradient buffers end with one spare element, as parameter buffers end with the weight: the
engine writes this rank's share of the sum there, so that the average stays an average of
the ranks that contributed when some have joined (hvd.join(): they serve with zeros).

Every operation on the buffers runs inside the adapter's ``BufferAccess``, which makes the
buffers hold the framework's current parameters before and writes them back after (a copy for
staged device tensors and TF variables; nothing where the buffers are the parameters' memory).
The exchange is PushSum over the cross-node graph (``sgp``, synchronous or overlapped),
symmetric pairwise averaging (``dpsgd``) or nothing (``allreduce``, where the gradients were
averaged over the world instead). Int8 and top-k gossip through compressed PushSum
(choco.py), random-k through exact gossip on shared entries (sparse.py; mixers.py chooses);
``local_steps`` decides which steps communicate, and an outer optimizer (SlowMo, DiLoCo)
moves the model after each average or gossip round of those (outer.py).

In fault-tolerant mode a lost peer surfaces in any of these operations as PeerLostError. In a
plain script the operation repairs the world there (runtime.repair) and goes on; under
hvd.elastic.run the error goes up to it. Either way the repair calls ``_world_changed``,
which rebuilds the graph over the survivors and folds the PushSum state (see there).
"""
from __future__ import annotations

import atexit
import inspect
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, TypeVar

import numpy as np

from hvd_sgp.common import checkpoint, recovery, runtime, schedule, telemetry, watchdog
from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.codecs import Codec, codec as make_codec
from hvd_sgp.common.errors import ConsistencyError, PeerLostError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.node import NodeShard, average_arrays, exact_average
from hvd_sgp.common.options import SgpOptions
from hvd_sgp.common.outer import OuterLoop
from hvd_sgp.common.mixers import build, feeds_back
from hvd_sgp.common.pushsum import PushSumMixer, absorb, drain, exchange, release
from hvd_sgp.common.topology import BipartiteExponentialGraph, make_topology
from hvd_sgp.common.transport import PeerTransport, Progress
from hvd_sgp.common.waiting import Wait

T = TypeVar("T")


class BufferAccess(Protocol):
    """How the engine reaches the parameters: ``run(action)`` runs ``action`` while the
    buffers hold the framework's current parameters, and writes the buffers back after."""

    def run(self, action: Callable[[], T]) -> T: ...


class DirectAccess:
    """The buffers are the parameters' own memory (numpy views, CUDA-aware device tensors)."""

    def run(self, action: Callable[[], T]) -> T:
        return action()


@dataclass(frozen=True)
class StepPlan:
    """What the coming step does, as begin_step decided it."""

    mode: str  # the exchange after the local step: "sgp", "dpsgd" or "allreduce"
    reduce: bool  # gradients must be summed first (over the world in allreduce, else the node)
    entered_allreduce: bool  # switched into AllReduce SGD: parameters and state were averaged
    ranks: int  # how many ranks reduce_gradients sums (1 without a reduction)


class GossipEngine:
    """SGP state of one optimizer on this rank."""

    def __init__(self, buffers: Sequence, options: SgpOptions, signature: Sequence[tuple],
                 codec: "str | Codec" = "none", access: BufferAccess = DirectAccess(),
                 layout: Optional[runtime.Layout] = None,
                 succeeds: Optional["GossipEngine"] = None):
        """``succeeds``: the engine this one replaces on a survivor after replacements joined
        (see retire); its iteration, epoch, timeline and repair records go on."""
        self.options = options
        self.buffers = list(buffers)
        self.access = access
        layout = layout or runtime.layout()  # the world's, or a process set's
        self.world, self.local, self.cross = layout.world, layout.local, layout.cross
        self.codec = make_codec(codec)
        self.steps = check_consistent(self.world, [tuple(map(str, s)) for s in signature],
                                      options.describe() + (self.codec.spec,),
                                      succeeds.steps if succeeds is not None else 0)
        self.stages = (schedule.parse(options.schedule) if options.schedule else
                       [schedule.Stage(0, "epoch", options.mode, options.peers, options.overlap)])
        if any(s.overlap for s in self.stages) and not runtime.mpi_threads_supported():
            raise SgpValueError("Overlap SGP needs MPI_THREAD_MULTIPLE, which this MPI did not "
                                "grant; use an MPI built with thread support or overlap=False")
        watchdog.set_timeout(options.timeout)
        self.transport = PeerTransport(self.cross, options.timeout)
        path = telemetry.timeline_path()
        if succeeds is not None:
            self.timeline = succeeds.timeline
        else:
            self.timeline = (telemetry.Timeline(path, self.world.Get_rank(),
                                                self.world.Get_size()) if path else None)
            if self.timeline is not None:
                atexit.register(self.timeline.finish)
        self.transport.timeline = self.timeline
        self.metrics_log = (telemetry.MetricsLog(options.metrics, options.metrics_every,
                                                 self.world, describe_run(options, self.codec))
                            if options.metrics else None)
        self.progress = None
        self.elastic = telemetry.ElasticConsistency()
        self.outer = OuterLoop(options.local_steps, options.slowmo, options.slowmo_lr,
                               options.outer_optimizer, options.outer_fragments)
        self.outer.average = lambda buf, w: exact_average(buf, self.cross, self.local, w)
        self.epoch = 0
        # self.steps, set above: exchanges, the graph's iteration, equal on every rank
        self.calls = 0  # end_step calls: the user's loop position (see _world_changed)
        self._in_call = False  # between a begin_step and its end_step
        self._skip_until = 0  # after a repair, calls before this one do not communicate,
        self._resync_at = 0  # and this one begins with an exact average
        self._planned_ranks = 1  # the ranks begin_step told the adapter to scale for
        self.repairs: list[dict] = []  # one record per repair this engine went through
        self.retired = False  # replacements joined: the session starts a successor
        self.stage = None
        self.mixers: list[PushSumMixer] = []
        self._depth = 0  # nesting of _live: only the outermost call goes through access
        self._closed = False
        self._optimizer_state: Callable[[], Sequence] = tuple  # the adapter's, for serving
        self._serving = False  # this rank has joined: it contributes nothing to gradients
        self._zeros: list = []  # zero gradient buffers that a joined rank contributes
        self._sum_in_node: Optional[Callable] = None  # the peers' in-node sum (NCCL), reused
        self._joined_group: Optional[MPI.Comm] = None  # some of its ranks served this step
        self._resync_source: Optional[tuple] = None  # (group, rank) that re-synced them
        self._server: Optional[threading.Thread] = None  # the served step in progress
        self._server_failure: Optional[BaseException] = None
        self._serve_target = 0  # the step the joined rank has begun serving
        self._check_position = True  # agree on the iteration at the next step (checkpoint.py)
        self._restored = False  # this rank's own per-rank state was loaded (exact resume)
        if succeeds is not None:  # (the outer step's state starts afresh, as a replacement's)
            self.epoch = succeeds.epoch
            self.elastic, self.repairs = succeeds.elastic, succeeds.repairs
        self._enter(schedule.current(self.stages, self.epoch, self.steps))
        self._subscription = runtime.on_world_change(self._world_changed)
        atexit.register(_close_at_exit, weakref.ref(self))  # no progress thread in Finalize
        if self.cross.Get_size() == 1 and self.world.Get_size() > 1 and self.world.Get_rank() == 0:
            print(f"hvd_sgp: all {self.world.Get_size()} ranks share one node, so gradients are "
                  "averaged exactly and nothing is gossiped; set HVD_SGP_LOCAL_SIZE=1 to make "
                  "every rank its own SGP node", file=sys.stderr, flush=True)

    def _guard(self, action: Callable[[], T], what: str, retry: bool = True,
               on_repair: Callable[[], None] = lambda: None, access: bool = True) -> T:
        """Run a public operation. A lost peer (fault-tolerant mode) goes up as PeerLostError
        under hvd.elastic.run; in a plain script the world is repaired here, ``on_repair``
        undoes what the failed attempt left, and the operation runs again on the survivors
        (``retry``) or counts as done (a step whose exchange the repair's fold replaced).
        ``access`` off: the action does not need the buffers to hold the parameters."""
        while True:
            try:
                with recovery.translated(what), watchdog.doing(what, self.steps):
                    return self._live(action) if access else action()
            except PeerLostError:
                if not recovery.repairs_in_step():
                    raise
                runtime.repair(realign=True)
                on_repair()
                if not retry:
                    return None

    def _live(self, action: Callable[[], T]) -> T:
        """Run ``action`` with the buffers holding the parameters (see BufferAccess)."""
        if self._depth:
            return action()
        self._depth += 1
        try:
            return self.access.run(action)
        finally:
            self._depth -= 1

    # --- stages ---------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The exchange of the current stage."""
        return self.stage.mode

    @property
    def tracks_weight(self) -> bool:
        return any(m.track_weight for m in self.mixers)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _enter(self, stage: schedule.Stage,
               optimizer_state: Callable[[], Sequence] = tuple) -> None:
        """Switch exchange; every rank switches at the same step, so they stay consistent.
        Weights kept per entry (random-k where weights move) are folded in exactly first:
        the new stage's mixers start from weight 1."""
        drain(self.mixers)
        # AllReduce SGD must start from identical parameters and optimizer state
        to_allreduce = (self.stage is not None and stage.mode == "allreduce"
                        and self.stage.mode != "allreduce")
        if to_allreduce or any(m.entry_weights() is not None for m in self.mixers):
            self._average_parameters()
        if to_allreduce:
            average_arrays(list(optimizer_state()), self.world)
        was_tracking = self.stage is not None and self.tracks_weight
        self.stage = stage
        nodes = self.cross.Get_size()
        if stage.mode == "allreduce" or nodes == 1:
            # one SGP node: every local rank took the same step from the same averaged
            # gradients, so there is no peer to mix with and no shard to gather back
            self.mixers = []
            return
        if stage.mode == "dpsgd":
            topology, push_sum = BipartiteExponentialGraph(nodes, stage.peers), False
        else:
            topology = make_topology(self.options.topology, nodes, stage.peers)
            push_sum = self.options.push_sum
        if stage.overlap and self.progress is None:
            self.progress = Progress(self.transport)
        self.mixers = [build(buf, topology, self.transport, local=self.local,
                             push_sum=push_sum, codec=self.codec,
                             progress=self.progress if stage.overlap else None,
                             max_delay=self.options.max_delay,
                             consensus_step=self.options.consensus_step,
                             error_feedback=self.options.error_feedback,
                             in_place=True)  # the buffers are written after begin_step
                       for buf in self.outer.gossip_buffers(self.buffers)]
        self.outer.set_rounds(self.mixers, self.steps)
        if was_tracking and not self.tracks_weight:
            self._average_parameters()  # the new stage assumes weight 1: fold it in exactly

    # --- the step -----------------------------------------------------------------------
    def begin_step(self, optimizer_state: Callable[[], Sequence] = tuple,
                   before_local_step: bool = True) -> StepPlan:
        """Switch stage where the schedule says so, and say what this step does.

        Entering AllReduce SGD averages the parameters and the arrays ``optimizer_state()``
        returns (momentum, Adam moments: arrays of any registered kit), in place on every rank,
        so that all ranks take the same steps from there on. ``before_local_step`` off: end_step
        begins the step itself (see there).
        """
        self._optimizer_state = _weakly(optimizer_state)
        self.release()  # before the adapter reaches the buffers (a staged copy writes them)
        plan = self._guard(lambda: self._begin_step(self._optimizer_state, before_local_step),
                           "the start of a step")
        self._in_call = True
        return plan

    def _begin_step(self, optimizer_state: Callable[[], Sequence],
                    before_local_step: bool = True) -> StepPlan:
        if before_local_step:  # (else the mixers push a copy, and sum in after it)
            absorb(self.mixers)  # what in-place pushes kept out of the buffers, before the step
        call = self.calls + 1
        if call < self._skip_until:  # realigning after a repair: a local step only
            self._planned_ranks = 1
            return StepPlan(self.stage.mode, False, False, 1)
        self._agree_position()
        if call == self._resync_at:
            self._average_parameters()
            self.repairs[-1]["met_at"] = call  # (the repair's record: the survivors met)
            if self.stage.mode == "allreduce":
                average_arrays(list(optimizer_state()), self.world)
        wanted = schedule.current(self.stages, self.epoch, self.steps)
        entered = False
        if wanted != self.stage:
            entered = wanted.mode == "allreduce" and self.stage.mode != "allreduce"
            self._enter(wanted, optimizer_state)
        mode = self.stage.mode
        world = self.outer.averages_gradients(mode)
        ranks = (self.world if world else self.local).Get_size()
        self._planned_ranks = ranks
        return StepPlan(mode, ranks > 1, entered, ranks)

    def reduce_gradients(self, grads, sum_in_node: Optional[Callable] = None) -> None:
        """Sum gradients in place over the plan's ranks (the node, or the world for AllReduce
        SGD); ``sum_in_node`` replaces MPI for the node's sum (NCCL). The adapter scaled them
        by 1 / plan.ranks in the copy that fused them, so the sum is the average without
        another pass; only when ranks have joined is it rescaled to the contributors'.
        Local SGD (AllReduce mode with local_steps > 1) sums over the node only."""
        backup = None
        if recovery.enabled():  # a failed reduction leaves the gradients undefined
            backup = kit_for(grads).empty(grads, tuple(grads.shape))
            backup[...] = grads

        def restore() -> None:
            grads[...] = backup

        self._guard(lambda: self._reduce_gradients(grads, sum_in_node), "the gradient sum",
                    on_repair=restore)

    def _reduce_gradients(self, grads, sum_in_node: Optional[Callable]) -> None:
        world = self.outer.averages_gradients(self.stage.mode)
        comm = self.world if world else self.local
        skipped = self.calls + 1 < self._skip_until  # realigning after a repair: local only
        ranks = 1 if skipped else comm.Get_size()
        if ranks != self._planned_ranks:  # a repair since begin_step: the adapter scaled
            grads[:-1] *= self._planned_ranks / ranks  # by 1 / (the ranks it planned for)
        if ranks == 1:
            return
        grads[-1] = 0.0 if self._serving else 1.0 / ranks  # this rank's share of the sum
        if self._serving:
            sum_in_node = self._sum_in_node  # a joined rank sums as its peers do
        else:
            self._sum_in_node = sum_in_node
        if sum_in_node is not None and not world:
            sum_in_node(grads)
        else:
            kit_for(grads).ready(grads)
            comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        share = float(grads[-1])
        if 0.0 < share < 1.0 - 1e-6:
            grads[:-1] /= share
            self._joined_group = comm  # the joined ranks of this group are re-synced

    def end_step(self, lr: float = 0.0) -> None:
        """The exchange that follows each local step (``lr``: for the consensus metrics).
        The step protocol: an adapter that needs the plan (to reduce gradients) calls
        begin_step before its local step; one that does not may skip it, and end_step then
        begins the step itself, so that what begin_step owes a step (a stage switch, the
        exact average of the step where survivors meet after a repair) is never lost. (Its
        Overlap SGP pushes are then copies: an in-place push needs the arrivals summed in
        before the local step.)"""
        if not self._in_call:
            self.begin_step(self._optimizer_state, before_local_step=False)
        self.calls += 1
        self._in_call = False
        if self.calls < self._skip_until:
            return
        self._guard(lambda: self._end_step(lr), "the exchange", retry=False)

    def _end_step(self, lr: float) -> None:
        self._agree_position()  # (an adapter that needs no begin_step comes here first)
        mode = self.stage.mode
        if self.steps == 0 and self.cross.Get_size() == 1:
            for buf in self.buffers:  # once: local ranks whose start was not broadcast agree
                NodeShard(buf, self.local).gather()
        if self._joined_group is not None:
            self._resync(self._joined_group)
        self.steps += 1
        mixers = self.outer.gossiping(self.mixers, self.steps, self.buffers)
        if self.timeline is not None:
            self.timeline.step_boundary(self.steps)
            with self.timeline.span("send/receive", step=self.steps, mode=mode):
                exchange(mixers)
            self.timeline.resume_compute()
        else:
            exchange(mixers)
        if self.outer.synchronizes(self.steps, mode):
            self._average_parameters()
        if self.outer.steps_outer(self.steps):
            drain(self.mixers)  # Overlap SGP: the outer step takes the whole round's mix
            self.outer.update(self.buffers, lr)
        if self.metrics_log is not None:
            self.metrics_log.record(self.steps, self.parameters(), float(self.buffers[0][-1]), lr)

    # --- join(): a rank out of data serves its peers ---------------------------------------
    # While this rank is joined, each served step (schedule, zero gradients where the peers
    # sum theirs, the exchange of its own parameters and weight) runs on a thread: it blocks
    # in MPI until the peers take that step, and meanwhile join() must keep serving the
    # negotiated collectives, and learn when every rank has joined. A step begun then is
    # counted in started_iteration, so every rank's finish() takes it too.
    def started_iteration(self) -> int:
        """Steps this rank has begun (the join protocol's agreement)."""
        return max(self.steps, self._serve_target)

    def serve(self, poll: Callable[[], object]) -> bool:
        """Begin one served step, or report whether the one running has ended (no wait)."""
        if self._server is not None:
            if self._server.is_alive():
                return False
            self._end_served_step()
            return True
        self._serving = True
        self._serve_target = self.steps + 1
        if not runtime.mpi_threads_supported():  # no MPI from two threads: serve in line
            self._served_step()
            self._end_served_step()
            return True
        self._server = threading.Thread(target=self._served_step, daemon=True,
                                        name="hvd_sgp join server")
        self._server.start()
        return True

    def _served_step(self) -> None:
        try:
            plan = self.begin_step(self._optimizer_state)
            if plan.reduce:
                if not self._zeros:
                    self._zeros = [kit_for(b).empty(b, (len(b),)) for b in self.buffers]
                for zeros in self._zeros:
                    zeros[...] = 0
                    self.reduce_gradients(zeros)
            self.end_step()
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
        self._serving = True
        try:
            if self._server is not None:
                server = self._server
                Wait("a served step", lambda: "the peers of this joined rank",
                     self.transport.timeout, self._serve_target).until(
                         lambda: poll() or server.join(1e-3) or not server.is_alive())
                self._end_served_step()
            while self.steps < last:
                self._served_step()
                self._end_served_step()
            self.drain()
        finally:
            self._serving, self._serve_target = False, 0
        if self._resync_source is not None:
            self._live(self._resync_optimizer_state)

    def _wait(self, request: MPI.Request, what: str, comm: MPI.Comm) -> None:
        """Wait for a non-blocking collective within HVD_SGP_TIMEOUT."""
        Wait(what, lambda: f"the other ranks of its group of {comm.Get_size()}",
             self.transport.timeout, self.steps).until(request.Test)

    def _resync(self, comm: MPI.Comm) -> None:
        """After a step where some ranks of ``comm`` had joined: those ranks did not update,
        so the lowest rank that did sends its parameters (which every rank that updated
        shares) to the group, before shards are mixed or gathered."""
        mine = np.array([comm.Get_size() if self._serving else comm.Get_rank()], np.int64)
        self._wait(comm.Iallreduce(MPI.IN_PLACE, mine, op=MPI.MIN), "join re-sync", comm)
        self._joined_group, self._resync_source = None, (comm, int(mine[0]))
        for buf in self.buffers:  # not the weight: under Overlap SGP each rank has its own
            with kit_for(buf).for_mpi(buf) as view:
                self._wait(comm.Ibcast(view[:-1], root=int(mine[0])), "join re-sync", comm)

    def _resync_optimizer_state(self) -> None:
        """At the end of join(): the optimizer state (momentum, moments) of the ranks that
        served is the updating ranks' too (ranks that never stepped have none to receive)."""
        comm, root = self._resync_source
        self._resync_source = None
        arrays = list(self._optimizer_state())
        layouts = comm.allgather([(str(kit_for(a).numpy_dtype(a)), tuple(a.shape))
                                  for a in arrays])
        if any(other != layouts[root] for other in layouts):
            return
        for array in arrays:
            with kit_for(array).for_mpi(array) as view:
                comm.Bcast(view, root=root)

    def parameters(self) -> np.ndarray:
        """All de-biased parameters as one host vector (a view for one numpy buffer)."""
        if len(self.buffers) == 1 and isinstance(self.buffers[0], np.ndarray):
            return self.buffers[0][:-1]
        return np.concatenate([kit_for(b).to_numpy(b[:-1]) for b in self.buffers])

    def consensus(self, lr: float = 0.0) -> dict:
        """On request, one allreduce: this rank's deviation from the network mean, the
        consensus distance and the elastic-consistency estimate (max deviation / lr)."""
        def measure() -> dict:
            drain(self.mixers)
            result = telemetry.consensus(self.parameters(), self.world)
            result["elastic"] = self.elastic.update(result["deviation"], lr)
            return result
        return self._guard(measure, "the consensus measure")

    def release(self) -> None:
        """Wait until no push in flight reads the buffers in place (Overlap SGP, tau = 1): the
        local step, or an adapter loading new values, writes them next."""
        self._guard(lambda: release(self.mixers), "the pushes in flight", access=False)

    def drain(self) -> None:
        """Complete every exchange in flight (only Overlap SGP leaves any between steps)."""
        self._guard(lambda: drain(self.mixers), "draining the exchanges in flight")

    def average_parameters(self) -> None:
        """Exact consensus: every rank gets sum_i(w_i z_i) / sum_i(w_i), and weight 1."""
        self._guard(self._average_parameters, "the exact average")

    def _average_parameters(self) -> None:
        drain(self.mixers)
        if not self.outer.fold(self.buffers, self.mixers):  # (fragments: each by its weight)
            self._fold([m.entry_weights() for m in self.mixers])
        for mixer in self.mixers:
            mixer.reset_weights()

    def _fold(self, entry_weights: Sequence) -> None:
        """The exact average of every buffer, by its slot's weight or, where the mixers kept
        one per entry, by those (``entry_weights``, one array or None per buffer)."""
        for i, buf in enumerate(self.buffers):
            weights = entry_weights[i] if i < len(entry_weights) else None
            exact_average(buf, self.cross, self.local, weights)

    # --- state and figures ---------------------------------------------------------------
    def state(self) -> dict:
        """The checkpoint contract of both frameworks (see checkpoint.py). Local: Horovod's
        recipe calls it on rank 0 alone. Messages in flight (Overlap SGP) are summed in where
        that needs no other rank of the node; otherwise the state says it is not settled, and
        its per-rank part is not restored (``synchronize_gossip()`` on every rank first makes
        it exact)."""
        def read() -> dict:
            live = not self.retired  # (a retired engine's communicators went with its world)
            if live and self.local.Get_size() == 1:
                drain(self.mixers)  # point to point only: the peers' sends are posted
            state = {"iteration": self.steps, "epoch": self.epoch,
                     "weights": [float(b[-1]) for b in self.buffers],
                     "rank": self.world.Get_rank() if live else None,
                     "size": self.world.Get_size() if live else None,
                     "settled": not _in_flight(self.mixers)}
            if self.outer.step is not None:
                state["outer"] = self.outer.state()
            if self.codec.differential:
                state["compressed"] = [m.state() for m in self.mixers]
            return state
        return self._guard(read, "reading the SGP state")

    def load_state(self, state: dict) -> None:
        """Restore ``state()`` on this rank (no communication). The per-rank part only from
        this rank's own checkpoint of this world (checkpoint.own); the ranks compare where
        they are at the next step."""
        weights = state["weights"]
        if len(weights) != len(self.buffers):
            raise SgpValueError(f"checkpoint has {len(weights)} PushSum buffers, this model "
                                f"has {len(self.buffers)}")
        mine = checkpoint.own(state, self.world.Get_rank(), self.world.Get_size())

        def load() -> None:
            if _in_flight(self.mixers):  # (a new optimizer has none: no other rank needed)
                drain(self.mixers)
            self._restart(int(state["iteration"]), int(state.get("epoch", 0)),
                          state.get("outer", state.get("slowmo")))  # (SlowMo's older name)
            if not mine:
                return
            for buf, w in zip(self.buffers, weights):
                buf[-1] = w
            for mixer, copies in zip(self.mixers, state.get("compressed", ())):
                mixer.load_state(copies)
            self._restored = True
        self._guard(load, "loading the SGP state")

    def adopt(self, shared: dict) -> None:
        """Horovod's recipe, after root's parameters reached every rank: take root's shared
        state (``checkpoint.shared``) and start the per-rank state afresh, weight 1 and no
        copies: the exact state of a consensus. Every rank calls it, at one point of its loop."""
        def adopt() -> None:
            drain(self.mixers)
            self._restart(int(shared.get("iteration", self.steps)),
                          int(shared.get("epoch", self.epoch)),
                          shared.get("outer", shared.get("slowmo")))
        self._guard(adopt, "adopting root's SGP state")

    def _restart(self, steps: int, epoch: int, outer: Optional[dict]) -> None:
        """Stand at iteration ``steps`` with nothing in flight, weight 1 and fresh mixers
        (restoring, not switching: nothing to average); check the position at the next step."""
        self.steps, self.epoch = steps, epoch
        for buf in self.buffers:
            buf[-1] = 1
        self._skip_until = self._resync_at = 0
        self.stage, self.mixers = None, []
        self._enter(schedule.current(self.stages, self.epoch, self.steps))
        self.outer.load_state(outer)
        self._restored, self._check_position = False, True

    def _agree_position(self) -> None:
        """Once after a start, a load or a broadcast: every rank at the same iteration, or
        one error on every rank naming where each stands (instead of a timeout at the first
        exchange); per-rank state restored on some ranks only starts afresh everywhere."""
        if not self._check_position:
            return
        self._check_position = False
        if checkpoint.agree(self.world, self.steps, self._restored,
                            lambda request, what: self._wait(request, what, self.world)):
            self._restart(self.steps, self.epoch, self.outer.state())
            self._check_position = False

    def metrics(self) -> dict:
        """Cheap per-rank figures (no communication)."""
        stats = self.transport.stats
        return {"weight": float(self.buffers[0][-1]) if self.buffers else 1.0,
                "wait_seconds": stats.last_wait_seconds,
                "total_wait_seconds": stats.wait_seconds,
                "bytes_sent": stats.bytes_sent, "iteration": self.steps,
                "mode": self.stage.mode, "overlap": self.stage.overlap,
                "codec_seconds": sum(getattr(m, "codec_seconds", 0.0) for m in self.mixers)}

    @property
    def closed(self) -> bool:
        return self._closed

    def reset_weights(self) -> None:
        """After the parameters were made identical on every rank from outside (hvd.elastic's
        sync broadcasts rank 0's model), drop the messages in flight and set every PushSum
        weight to 1: the exact state of a consensus. Call it on every rank."""
        def reset() -> None:
            for mixer in self.mixers:
                mixer.abandon()
            steps = int(self.world.allreduce(self.steps, op=MPI.MAX))
            self._restart(steps, self.epoch, self.outer.state())
        self._guard(reset, "resetting the PushSum weights")

    # --- repair after a lost rank (fault-tolerant mode) ---------------------------------------
    def _world_changed(self, change: "runtime.WorldChange") -> None:
        """Rebuild on the survivors and fold the PushSum state; called by runtime.repair().

        1. Every iteration in flight is abandoned: each mixer de-biases its shard as it stands
           (the share it kept plus what it had summed in), and messages still in flight, to or
           from anyone, are dropped with the old communicators, never added later.
        2. The transport and the graph are rebuilt for the new number of nodes.
        3. The fold: an exact weighted average over the survivors, sum_i(w_i z_i) / sum_i(w_i),
           after which every weight is 1 (the survivors' total weight is their number). The
           mass the lost rank held and the mass in flight are gone; the survivors' de-biased
           average is kept exactly (``repairs`` records the mass held before and after), and
           no message can be counted twice. In AllReduce SGD the optimizer state is averaged
           too.
        4. The iteration count becomes the survivors' largest. In a plain script
           (``change.realign``) the survivors noticed the failure at different points of their
           loops: each names the first step it will begin after the repair (the one after the
           step it is in), and every rank takes its steps before the latest of these locally,
           without communicating, so that all meet at that step, which begins with one more
           exact average. (Under hvd.elastic.run the training function restarts from the
           synced state instead.)
        """
        if change.joined:
            self.retire(change)
            return

        def repair() -> None:
            began = time.monotonic()
            if self.progress is not None:
                self.progress.close()
                self.progress = None
            for mixer in self.mixers:
                mixer.abandon()
            entry_weights = [m.entry_weights() for m in self.mixers]
            self.transport.free()
            self.world, self.local, self.cross = change.world, change.local, change.cross
            self.transport = PeerTransport(self.cross, self.options.timeout)
            self.transport.timeline = self.timeline
            if self.metrics_log is not None:
                self.metrics_log.comm = self.world
            resume = self.calls + (2 if self._in_call else 1)
            agreed = np.array([self.steps, resume], dtype=np.int64)
            self.world.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
            steps, meet = agreed.tolist()
            self.steps = steps
            self._skip_until = self._resync_at = meet if change.realign else 0
            self.stage, self.mixers = None, []
            self._enter(schedule.current(self.stages, self.epoch, self.steps))
            held = self._mass()
            self._fold(entry_weights)
            self.outer.load_state(None)  # the fold replaced every anchor's model: start afresh
            if self.stage.mode == "allreduce":
                average_arrays(list(self._optimizer_state()), self.world)
            self.repairs.append({"lost": list(change.lost), "size": self.world.Get_size(),
                                 "iteration": self.steps, "held": held, "after": self._mass(),
                                 "skipped_to": self._skip_until,
                                 "seconds": time.monotonic() - began})
        self._live(repair)

    def retire(self, change: "runtime.WorldChange") -> None:
        """Replacements joined the world (runtime._grow), right after the repair's fold made
        every survivor's weight 1 and its parameters the survivors' exact average. A
        replacement starts its engine at its first use of the optimizer, a collective; this
        survivor's session starts a successor engine at that same point (``succeeds``), so
        this one stands aside without communicating: nothing is in flight after the fold,
        and the weight stays 1. With the replacements' weight 1 and their parameters synced
        from rank 0 (hvd.elastic's ``state.sync()``), the world's total weight is its size
        and the de-biased average is the survivors' fold, unchanged."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for mixer in self.mixers:
            mixer.abandon()
        self.mixers = []
        self.transport.free()
        runtime.forget_world_change(self._subscription)
        self.repairs.append({"joined": list(change.joined), "size": change.world.Get_size(),
                             "iteration": self.steps})
        self.retired = self._closed = True  # (its timeline goes on in the successor)

    def _mass(self) -> list:
        """The survivors' PushSum mass, summed over ranks: [sum of w * z over every parameter,
        sum of w] per buffer (one allreduce; for the repair ledger)."""
        local = [x for buf in self.buffers
                 for x in (float(buf[-1]) * kit_for(buf).total(buf[:-1]), float(buf[-1]))]
        if self.local.Get_size() > 1:  # one copy per node: count it once
            local = [x if self.local.Get_rank() == 0 else 0.0 for x in local]
        total = np.array(local, dtype=np.float64)
        self.world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total.tolist()

    def close(self) -> None:
        """Stop the progress thread and release the communicator (no communication: it also
        runs when the optimizer is collected, on one rank only)."""
        if self._closed:
            return
        self._closed = True
        runtime.forget_world_change(self._subscription)
        if self.timeline is not None:
            self.timeline.close()
        if self.progress is not None:
            self.progress.close()
        self.transport.free()


def _in_flight(mixers: Sequence[PushSumMixer]) -> bool:
    """Whether an Overlap SGP exchange is still under way."""
    return any(getattr(m, "in_flight", None) for m in mixers)


def _weakly(function: Callable[[], Sequence]) -> Callable[[], Sequence]:
    """``function`` without keeping its object alive: the engine outlives no optimizer (its
    close runs when the optimizer is collected)."""
    if not inspect.ismethod(function):
        return function
    method = weakref.WeakMethod(function)
    return lambda: method()() if method() is not None else ()


def _close_at_exit(engine: "weakref.ref[GossipEngine]") -> None:
    alive = engine()
    if alive is not None:
        alive.close()


def describe_run(options: SgpOptions, codec: Codec = Codec()) -> str:
    """A short label for logs and plots, e.g. 'sgp exponential peers=1' or
    'sgp exponential peers=1 overlap tau=2 topk:0.01 no-ef'."""
    topology = options.topology if isinstance(options.topology, str) else repr(options.topology)
    label = options.schedule or f"{options.mode} {topology} peers={options.peers}"
    label += f" overlap tau={options.max_delay}" if options.overlap else ""
    if codec.spec != "none":
        label += f" {codec.spec}" + ("" if options.error_feedback or not feeds_back(codec)
                                     else " no-ef")
    label += f" H={options.local_steps}" if options.local_steps > 1 else ""
    label += f" outer={options.outer_optimizer}" if options.outer_optimizer is not None else ""
    label += f" fragments={options.outer_fragments}" if options.outer_fragments > 1 else ""
    return label + (f" slowmo={options.slowmo:g}" if options.slowmo is not None else "")


def check_consistent(comm: MPI.Comm, signature: list, opts: tuple, iteration: int = 0) -> int:
    """One allgather: every rank must have the same parameters (count, shapes, dtypes, order)
    and the same SGP options; otherwise raise on every rank naming those that differ. Returns
    the largest ``iteration`` given: where the graph starts (a replacement joins survivors
    that are further on)."""
    everyone = comm.allgather((signature, opts, iteration))
    for what, index in (("parameters (names, shapes, dtypes, order)", 0), ("SGP options", 1)):
        differ = [r for r, entry in enumerate(everyone) if entry[index] != everyone[0][index]]
        if differ:
            detail = _first_difference(everyone[0][index], everyone[differ[0]][index])
            raise ConsistencyError(f"ranks {differ} have different {what} from rank 0: "
                                   f"{detail}")
    return max(entry[2] for entry in everyone)


def _first_difference(a, b) -> str:
    if len(a) != len(b):
        return f"{len(b)} entries against rank 0's {len(a)}"
    for x, y in zip(a, b):
        if x != y:
            return f"{y!r} where rank 0 has {x!r}"
    return "differ"
