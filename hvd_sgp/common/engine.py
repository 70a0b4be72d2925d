"""The framework-free SGP driver behind every DistributedOptimizer: the step and its stages.

An adapter hands it flat buffers (one per dtype: parameters + weight slot, see
pushsum.allocate; numpy, or device tensors of a registered kit, see arrays.py) and drives each
step by the protocol of step_protocol.py: begin_step, reduce_gradients, the adapter's local
step, end_step. The exchange is PushSum over the cross-node graph (``sgp``, synchronous or
overlapped), symmetric pairwise averaging (``dpsgd``) or nothing (``allreduce``, where the
gradients were averaged over the world instead). Int8 and top-k gossip through compressed
PushSum (choco.py), random-k through exact gossip on shared entries (sparse.py; mixers.py
chooses); ``local_steps`` decides which steps communicate, and an outer optimizer (SlowMo,
DiLoCo) moves the model after each average or gossip round of those (outer.py). A local step
taken at a PushSum weight other than 1 moves the numerator as SGP's does, and ranks with
uneven batches weigh by their samples (``samples_per_step``; both in local_update.py).

Three collaborators work through the engine's public methods and attributes: ``join``
(join_serving.py: a joined rank's served steps), ``repair`` (repair.py: the fold and the
realignment after a lost rank, retiring when replacements join) and ``checkpoint``
(checkpoint.py: state(), load(), adopt() and the agreement on the position).
"""
from __future__ import annotations

import atexit
import inspect
import sys
import weakref
from itertools import chain, repeat
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np

from hvd_sgp.common import blocking, recovery, runtime, schedule, telemetry, watchdog
from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.checkpoint import EngineCheckpoint, check_consistent
from hvd_sgp.common.codecs import Codec, codec as make_codec
from hvd_sgp.common.errors import PeerLostError, SgpValueError
from hvd_sgp.common.join_serving import JoinServing
from hvd_sgp.common.local_update import LocalUpdates
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.node import NodeShard, average_arrays, exact_average, fold_scratch, in_node
from hvd_sgp.common.options import SgpOptions
from hvd_sgp.common.outer import OuterLoop
from hvd_sgp.common.mixers import build, feeds_back
from hvd_sgp.common.pushsum import PushSumMixer, absorb, drain, exchange, release
from hvd_sgp.common.repair import Repair
from hvd_sgp.common.step_protocol import BufferAccess, DirectAccess, StepPlan
from hvd_sgp.common.topology import BipartiteExponentialGraph, make_topology
from hvd_sgp.common.transport import PeerTransport, Progress
from hvd_sgp.common.waiting import Wait

T = TypeVar("T")


class GossipEngine:
    """SGP state of one optimizer on this rank."""

    serials = 0  # the next engine's name (``serial``) on this rank

    def __init__(self, buffers: Sequence, options: SgpOptions, signature: Sequence[tuple],
                 codec: "str | Codec" = "none", access: BufferAccess = DirectAccess(),
                 layout: Optional[runtime.Layout] = None,
                 succeeds: Optional["GossipEngine"] = None):
        """``succeeds``: the engine this one replaces on a survivor after replacements joined
        (see Repair.retire); its iteration, epoch, timeline and repair records go on."""
        self.options = options
        self.buffers = list(buffers)
        # the fold's copies, ready for a repair (node.fold_scratch), in fault-tolerant mode;
        # a successor takes over its predecessor's, and its mixers' storage (pushsum.Slot)
        self.scratch = (fold_scratch(self.buffers, succeeds.scratch if succeeds else ())
                        if recovery.enabled() else [])
        self.storage = succeeds.storage if succeeds is not None else []
        self.access = access
        layout = layout or runtime.layout()  # the world's, or a process set's
        self.codec = make_codec(codec)
        self.steps, self.serial = check_consistent(
            layout.world, [tuple(map(str, s)) for s in signature],
            options.describe() + (self.codec.spec,), succeeds.steps if succeeds is not None else 0,
            GossipEngine.serials)
        GossipEngine.serials = self.serial + 1  # (watchdog.doing's owner: one name per engine)
        self.stages = (schedule.parse(options.schedule) if options.schedule else
                       [schedule.Stage(0, "epoch", options.mode, options.peers, options.overlap)])
        if any(s.overlap for s in self.stages) and not runtime.mpi_threads_supported():
            raise SgpValueError("Overlap SGP needs MPI_THREAD_MULTIPLE, which this MPI did not "
                                "grant; use an MPI built with thread support or overlap=False")
        watchdog.set_timeout(options.timeout)
        self.timeline = (succeeds.timeline if succeeds is not None else
                         telemetry.open_timeline(layout.world.Get_rank(), layout.world.Get_size()))
        label = telemetry.run_label(options, self.codec.spec, feeds_back(self.codec))
        self.metrics_log = (telemetry.MetricsLog(options.metrics, options.metrics_every,
                                                 layout.world, label) if options.metrics else None)
        self.local_updates = LocalUpdates(options.samples_per_step)  # (see local_update.py)
        self.connect(layout.world, layout.local, layout.cross)  # world, local, cross, transport
        self.progress = None
        self.elastic = telemetry.ElasticConsistency()
        self.outer = OuterLoop(options.local_steps, options.slowmo, options.slowmo_lr,
                               options.outer_optimizer, options.outer_fragments)
        self.outer.average = lambda buf, w: exact_average(buf, self.cross, self.local, w)
        self.epoch = 0
        # self.steps, set above: exchanges, the graph's iteration, equal on every rank
        self._lr = 0.0  # the last step's learning rate (an outer step landing early takes it)
        self.calls = 0  # end_step calls: the user's loop position (see Repair.world_changed)
        self.in_call = False  # between a begin_step and its end_step
        self._began = True  # the step's begin_step came before its local step
        self.meet_at = 0  # realigning after a repair: calls before it only step locally,
        # and it begins with an exact average (0: none; repair.py sets it, the step reads it)
        self._planned_ranks = 1  # the ranks begin_step told the adapter to scale for
        self.repairs: list[dict] = []  # one record per repair this engine went through
        self.retired = False  # replacements joined: the session starts a successor
        self.closed = False
        self.stage = None
        self.mixers: list[PushSumMixer] = []
        self._depth = 0  # nesting of live: only the outermost call goes through access
        self.optimizer_state: Callable[[], Sequence] = tuple  # the adapter's (see begin_step)
        self.join = JoinServing(self)
        self.checkpoint = EngineCheckpoint(self)
        if succeeds is not None:  # (the outer step's state starts afresh, as a replacement's)
            self.epoch = succeeds.epoch
            self.elastic, self.repairs = succeeds.elastic, succeeds.repairs
        self.restage()
        self.repair = Repair(self)  # (subscribes to world changes: at this point on every rank)
        atexit.register(_close_at_exit, weakref.ref(self))  # no progress thread in Finalize
        if self.cross.Get_size() == 1 and self.world.Get_size() > 1 and self.world.Get_rank() == 0:
            print(f"hvd_sgp: all {self.world.Get_size()} ranks share one node, so gradients are "
                  "averaged exactly and nothing is gossiped; set HVD_SGP_LOCAL_SIZE=1 to make "
                  "every rank its own SGP node", file=sys.stderr, flush=True)

    def guard(self, action: Callable[[], T], what: str, retry: bool = True,
              on_repair: Callable[[], None] = lambda: None, access: bool = True) -> T:
        """Run a public operation. A lost peer (fault-tolerant mode) goes up as PeerLostError
        under hvd.elastic.run; in a plain script the world is repaired here, ``on_repair``
        undoes what the failed attempt left, and the operation runs again on the survivors
        (``retry``) or counts as done (a step whose exchange the repair's fold replaced).
        ``access`` off: the action does not need the buffers to hold the parameters."""
        while True:
            try:
                with recovery.translated(what), blocking.doing(what, self.steps, self.serial):
                    return self.live(action) if access else action()
            except PeerLostError:
                if not recovery.repairs_in_step():
                    raise
                runtime.repair(realign=True)
                on_repair()
                if not retry:
                    return None

    def live(self, action: Callable[[], T]) -> T:
        """Run ``action`` with the buffers holding the parameters (see BufferAccess)."""
        if self._depth:
            return action()
        self._depth += 1
        try:
            return self.access.run(action)
        finally:
            self._depth -= 1

    def wait(self, request: MPI.Request, what: str, comm: MPI.Comm,
             probe: Optional[Callable[[], None]] = None) -> None:
        """Wait for a non-blocking collective on ``comm`` within HVD_SGP_TIMEOUT (``probe``:
        see Wait)."""
        Wait(what, lambda: f"the other ranks of its group of {comm.Get_size()}",
             self.transport.timeout, self.steps, probe=probe).until(request.Test)

    # --- stages ---------------------------------------------------------------------------
    @property
    def tracks_weight(self) -> bool:
        return any(m.track_weight for m in self.mixers)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def restage(self) -> None:
        """Fresh mixers for the schedule's stage at this iteration: a start, a restore or a
        repair, not a switch (nothing to drain or average)."""
        self.stage, self.mixers = None, []
        self._enter(schedule.current(self.stages, self.epoch, self.steps))

    def _enter(self, stage: schedule.Stage,
               optimizer_state: Callable[[], Sequence] = tuple) -> None:
        """Switch exchange; every rank switches at the same step, so they stay consistent.
        Weights kept per entry (random-k where weights move) are folded in exactly first:
        the new stage's mixers start from weight 1."""
        self._drain()
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
        gossips = stage.mode != "allreduce" and nodes > 1
        self.outer.defer(stage.overlap and gossips, self.options.max_delay)
        if not gossips:
            # one SGP node: every local rank took the same step from the same averaged
            # gradients, so there is no peer to mix with and no shard to gather back
            self.mixers, self.storage = [], []
            return
        if stage.mode == "dpsgd":
            topology, push_sum = BipartiteExponentialGraph(nodes, stage.peers), False
        else:
            topology = make_topology(self.options.topology, nodes, stage.peers)
            push_sum = self.options.push_sum
        if stage.overlap and self.progress is None:
            self.progress = Progress(self.transport)
        self.mixers = [build(buf, topology, self.transport, shard=in_node(self.local),
                             push_sum=push_sum, codec=self.codec,
                             progress=self.progress if stage.overlap else None,
                             max_delay=self.options.max_delay,
                             consensus_step=self.options.consensus_step,
                             error_feedback=self.options.error_feedback,
                             # the buffers are written after begin_step; a delayed outer
                             # step's pieces are not, so their pushes copy and never block
                             in_place=not self.outer.delay, slot=slot)
                       for buf, slot in zip(self.outer.gossip_buffers(self.buffers),
                                            chain(self.storage, repeat(None)))]
        self.storage = [mixer.slot for mixer in self.mixers]
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
        self.optimizer_state = _weakly(optimizer_state)
        self.release()  # before the adapter reaches the buffers (a staged copy writes them)
        plan = self.guard(lambda: self._begin_step(self.optimizer_state, before_local_step),
                          "the start of a step")
        self.in_call = True
        return plan

    def _begin_step(self, optimizer_state: Callable[[], Sequence],
                    before_local_step: bool = True) -> StepPlan:
        if before_local_step:  # (else the mixers push a copy, and sum in after it)
            absorb(self.mixers)  # what in-place pushes kept out of the buffers, before the step
        call = self.calls + 1
        if call < self.meet_at:  # realigning after a repair: a local step only
            self._planned_ranks = 1
            return StepPlan(self.stage.mode, False, False, 1)
        self.checkpoint.agree()
        if call == self.meet_at:
            self._average_parameters()
            self.repairs[-1]["met_at"] = call  # (the repair's record: the survivors met)
            if self.stage.mode == "allreduce":
                average_arrays(list(optimizer_state()), self.world)
        self.local_updates.measure(self.world, self.local)
        wanted = schedule.current(self.stages, self.epoch, self.steps)
        entered = False
        if wanted != self.stage:
            entered = wanted.mode == "allreduce" and self.stage.mode != "allreduce"
            self._enter(wanted, optimizer_state)
        mode = self.stage.mode
        world = self.outer.averages_gradients(mode)
        self._began = before_local_step
        if before_local_step and not world:
            self.local_updates.before_local_step(self.buffers, self._weights_move())
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

        self.guard(lambda: self._reduce_gradients(grads, sum_in_node), "the gradient sum",
                   on_repair=restore)

    def _reduce_gradients(self, grads, sum_in_node: Optional[Callable]) -> None:
        world = self.outer.averages_gradients(self.stage.mode)
        comm = self.world if world else self.local
        skipped = self.calls + 1 < self.meet_at  # realigning after a repair: local only
        ranks = 1 if skipped else comm.Get_size()
        if ranks != self._planned_ranks:  # a repair since begin_step: the adapter scaled
            grads[:-1] *= self._planned_ranks / ranks  # by 1 / (the ranks it planned for)
        if ranks == 1:
            return
        weight = 1.0  # uneven workers: this rank's samples over the group's mean
        if self.local_updates.weighs_samples:
            weight = self.local_updates.in_world if world else self.local_updates.in_node
            grads[:-1] *= weight
        grads[-1] = 0.0 if self.join.serving else weight / ranks  # its share of the sum
        sum_in_node = self.join.in_node_sum(sum_in_node)  # a joined rank sums as its peers do
        if sum_in_node is not None and not world:
            sum_in_node(grads)
        else:
            kit_for(grads).ready(grads)
            comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        share = float(grads[-1])
        if 0.0 < share < 1.0 - 1e-6:
            grads[:-1] /= share
            self.join.summed_partially(comm)  # the joined ranks of this group are re-synced

    def end_step(self, lr: float = 0.0) -> None:
        """The exchange that follows each local step (``lr``: for the consensus metrics).
        The step protocol: an adapter that needs the plan (to reduce gradients) calls
        begin_step before its local step; one that does not may skip it, and end_step then
        begins the step itself, so that what begin_step owes a step (a stage switch, the
        exact average of the step where survivors meet after a repair) is never lost. (Its
        Overlap SGP pushes are then copies: an in-place push needs the arrivals summed in
        before the local step.)"""
        if not self.in_call:
            self.begin_step(self.optimizer_state, before_local_step=False)
        self.calls += 1
        self.in_call = False
        if self.calls < self.meet_at:
            return
        self.guard(lambda: self._end_step(lr), "the exchange", retry=False)

    def _end_step(self, lr: float) -> None:
        self.checkpoint.agree()  # (an adapter that needs no begin_step comes here first)
        mode = self.stage.mode
        if self.steps == 0 and self.cross.Get_size() == 1:
            for buf in self.buffers:  # once: local ranks whose start was not broadcast agree
                NodeShard(buf, self.local).gather()
        self.join.resync()  # where ranks of a group served the last step
        self.steps += 1
        if not self.outer.averages_gradients(mode):  # the numerator step, uneven workers
            self.local_updates.after_local_step(self.buffers)
            if self.local_updates.scales_phases:
                self.local_updates.end_phase(self.buffers,
                                             self.outer.phase_ends(self.steps, self.buffers))
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
        self._lr = lr
        if self.outer.steps_outer(self.steps):
            # Overlap SGP: the outer step takes the whole round's mix
            drain(self.outer.landing_mixers(self.mixers))
            self.outer.update(self.buffers, lr)
        if self.metrics_log is not None:
            self.metrics_log.record(self.steps, self.parameters(), float(self.buffers[0][-1]), lr)
        if not self._began:  # the adapter skips begin_step: the next local step starts here
            self.local_updates.before_local_step(self.buffers, self._weights_move())

    def _weights_move(self) -> bool:
        """Whether a buffer's weight slot may hold a weight other than 1 that is all its
        entries' (not random-k's weight per run of entries); else it is not even read."""
        return self.tracks_weight and all(m.entry_weights() is None for m in self.mixers)

    def parameters(self) -> np.ndarray:
        """All de-biased parameters as one host vector (a view for one numpy buffer)."""
        if len(self.buffers) == 1 and isinstance(self.buffers[0], np.ndarray):
            return self.buffers[0][:-1]
        return np.concatenate([kit_for(b).to_numpy(b[:-1]) for b in self.buffers])

    def consensus(self, lr: float = 0.0) -> dict:
        """On request, one allreduce: this rank's deviation from the network mean, the
        consensus distance and the elastic-consistency estimate (max deviation / lr)."""
        def measure() -> dict:
            self._drain()
            result = telemetry.consensus(self.parameters(), self.world)
            result["elastic"] = self.elastic.update(result["deviation"], lr)
            return result
        return self.guard(measure, "the consensus measure")

    def release(self) -> None:
        """Wait until no push in flight reads the buffers in place (Overlap SGP, tau = 1): the
        local step, or an adapter loading new values, writes them next."""
        self.guard(lambda: release(self.mixers), "the pushes in flight", access=False)

    def drain(self) -> None:
        """Complete every exchange in flight (only Overlap SGP leaves any between steps)."""
        self.guard(self._drain, "draining the exchanges in flight")

    def _drain(self) -> None:
        """Every exchange in flight completed, and a delayed outer step's round landed (the
        first stage has none yet)."""
        drain(self.mixers)
        if self.stage is not None and self.outer.settles():
            self.outer.update(self.buffers, self._lr)

    def average_parameters(self) -> None:
        """Exact consensus: every rank gets sum_i(w_i z_i) / sum_i(w_i), and weight 1."""
        self.guard(self._average_parameters, "the exact average")

    def _average_parameters(self) -> None:
        self._drain()
        if not self.outer.fold(self.buffers, self.mixers):  # (fragments: each by its weight)
            self.fold([m.entry_weights() for m in self.mixers])
        for mixer in self.mixers:
            mixer.reset_weights()

    def fold(self, entry_weights: Sequence) -> None:
        """The exact average of every buffer, by its slot's weight or, where the mixers kept
        one per entry, by those (``entry_weights``, one array or None per buffer)."""
        for i, buf in enumerate(self.buffers):
            weights = entry_weights[i] if i < len(entry_weights) else None
            exact_average(buf, self.cross, self.local, weights,
                          self.scratch[i] if self.scratch else None)

    def metrics(self) -> dict:
        """Cheap per-rank figures (no communication)."""
        stats = self.transport.stats
        return {"weight": float(self.buffers[0][-1]) if self.buffers else 1.0,
                "wait_seconds": stats.last_wait_seconds,
                "total_wait_seconds": stats.wait_seconds,
                "bytes_sent": stats.bytes_sent, "iteration": self.steps,
                "mode": self.stage.mode, "overlap": self.stage.overlap,
                "codec_seconds": sum(getattr(m, "codec_seconds", 0.0) for m in self.mixers)}

    # --- communicators and lifecycle ------------------------------------------------------
    def stop_progress(self) -> None:
        """Stop Overlap SGP's progress thread (the next overlapped stage starts another)."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def connect(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm) -> None:
        """Communicate over these communicators (the start's, or a repaired world's, after
        the old transport was freed): a transport of its own over the cross-node one."""
        self.world, self.local, self.cross = world, local, cross
        self.local_updates.forget()
        self.transport = PeerTransport(cross, self.options.timeout)
        self.transport.timeline = self.timeline
        if self.metrics_log is not None:
            self.metrics_log.comm = world

    def close(self) -> None:
        """Stop the progress thread and release the communicator (no communication: it also
        runs once the optimizer is collected, on one rank only: finalizers.py)."""
        if self.closed:
            return
        self.closed = True
        self.repair.unsubscribe()
        if self.timeline is not None:
            self.timeline.close()
        self.stop_progress()
        self.transport.free()


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
