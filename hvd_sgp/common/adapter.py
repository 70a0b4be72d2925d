"""What every framework adapter shares, written once: Horovod's argument rules for
DistributedOptimizer, op=Sum, the explicit step (schedule switches included), the SGP extras,
the checkpoint contract and the engine's lifecycle.

A framework package keeps only its tensor <-> buffer bridge (a ``BufferAccess``) and the
Horovod-facing wrappers: it builds ``Settings`` with ``settings()``, owns one ``SgpSession``
per optimizer, and mixes ``GossipMethods`` into its optimizer class.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hvd_sgp.common import options as sgp_options
from hvd_sgp.common import checkpoint, finalizers, recovery, runtime, telemetry
from hvd_sgp.common.codecs import Codec
from hvd_sgp.common.engine import BufferAccess, GossipEngine, StepPlan
from hvd_sgp.common.errors import NotInitializedError, PeerLostError, SgpValueError
from hvd_sgp.common.horovod_api import collectives, join, process_sets
from hvd_sgp.common.horovod_api.collectives import ReduceOp
from hvd_sgp.common.horovod_api.compression import Tensors, gossip_codec
from hvd_sgp.common.mpi import MPI


@dataclass(frozen=True)
class Settings:
    """What one DistributedOptimizer (or tape) was asked for, validated."""

    options: Any  # options.SgpOptions
    codec: Codec
    sum_gradients: bool  # op=Sum: Horovod's sum over ranks, n times the average
    layout: Optional[runtime.Layout] = None  # a process set's ranks (None: the world's)


def settings(op: Any, compression: Any, sgp: dict, gradient_predivide_factor: float = 1.0,
             backward_passes_per_step: int = 1, tensors: Optional[Tensors] = None,
             process_set: Any = None) -> Settings:
    """Check Horovod's DistributedOptimizer arguments and resolve the SGP options (keywords,
    then HVD_SGP_* variables, then defaults); the same rules and messages in every framework.
    ``tensors``: the framework's numpy conversions, for a script's own Compressor. With a
    ``process_set`` other than the global one, every rank calls it (a collective)."""
    if not runtime.is_initialized():
        raise NotInitializedError()
    if op == ReduceOp.Adasum:
        raise SgpValueError("op=Adasum is not offered by hvd_sgp: SGP replaces the gradient "
                            "allreduce; use op=Average (or op=Sum)")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise SgpValueError(f"DistributedOptimizer supports op=Average or op=Sum, got {op!r}")
    if not gradient_predivide_factor > 0:
        raise SgpValueError(f"gradient_predivide_factor must be positive, got "
                            f"{gradient_predivide_factor!r}")
    if backward_passes_per_step < 1:
        raise SgpValueError(f"backward_passes_per_step must be >= 1, got "
                            f"{backward_passes_per_step}")
    return Settings(sgp_options.resolve(**sgp), gossip_codec(compression, tensors),
                    op == ReduceOp.Sum, process_set_layout(process_set))


def process_set_layout(process_set: Any) -> Optional[runtime.Layout]:
    """Where an optimizer restricted to a process set trains: SGP over the set's ranks (nodes
    as the world's, within the set), and alone on the ranks outside it, whose steps are
    local as under Horovod's optimizer outside its set. None for the global set."""
    if process_set is None or process_set is process_sets.global_process_set:
        return None
    comm = process_sets.process_set_comm(process_set)
    if comm is None:
        alone = MPI.COMM_SELF.Dup()
        return runtime.Layout(alone, alone.Dup(), alone.Dup())
    return runtime.split(comm.Dup())


class SgpSession:
    """One optimizer's SGP machinery on this rank: the engine (started at the first operation
    that needs it, a collective), the step protocol and the extras. Every call that touches
    the buffers goes through the adapter's ``access``."""

    def __init__(self, config: Settings, access: BufferAccess, buffers: Sequence,
                 signature: Sequence[tuple]):
        self.settings = config
        self.access = access
        self.buffers = list(buffers)
        self.signature = list(signature)
        self._engine: Optional[GossipEngine] = None
        self._epoch = 0
        # the optimizer's own saved step count (Keras: ``iterations``, restored with the
        # model): an engine that starts afresh starts at this iteration
        self.resume_at = 0
        _JoinServer.add(self)

    @property
    def layout(self) -> runtime.Layout:
        """The ranks this optimizer trains with: the world, or its process set."""
        return self.settings.layout or runtime.layout()

    @property
    def started(self) -> bool:
        """Whether an engine runs (one retired when replacements joined does not count: the
        next use starts its successor, alongside the replacements' first engines)."""
        return self._engine is not None and not self._engine.retired

    def start(self) -> GossipEngine:
        """Create the engine if it is not running: a collective (every rank must get here at
        the same point; it compares parameters and options across ranks)."""
        while not self.started:
            retired = self._engine
            try:
                with recovery.translated("the start of the optimizer"):
                    engine = GossipEngine(self.buffers, self.settings.options,
                                          self.signature, self.settings.codec, self.access,
                                          self.layout, succeeds=retired)
                engine.set_epoch(self._epoch)
                self._engine = engine
                if retired is None and engine.steps == 0 and self.resume_at:
                    # checked at the first step, as every adopted position is
                    engine.checkpoint.adopt({"iteration": self.resume_at})
            except PeerLostError:  # a rank lost before the first step: start on the rest
                if not recovery.repairs_in_step():
                    raise
                runtime.repair()
        return self._engine

    def start_at_wrapping(self) -> None:
        """Start when the optimizer is wrapped, so that ranks compare their models and options
        there. Not on a replacement (runtime.replacement): the survivors it joins are past
        that point, so its engine starts at its first use, where the survivors start their
        engines' successors (repair.Repair.retire)."""
        if not runtime.replacement():
            self.start()

    @property
    def engine(self) -> GossipEngine:
        """The engine, started on first use (see start)."""
        return self.start()

    def own(self, owner: object) -> None:
        """Close the engine once ``owner`` (the optimizer) is collected (at the next safe
        point: finalizers.py)."""
        weakref.finalize(owner, finalizers.later, self.close)

    # --- the step -----------------------------------------------------------------------
    def begin_step(self, optimizer_state: Callable[[], Sequence] = tuple) -> StepPlan:
        finalizers.run()  # the optimizers collected since the last step close here
        return self.engine.begin_step(optimizer_state)

    def gradient_scale(self, plan: Optional[StepPlan] = None) -> float:
        """The factor on this rank's gradients before ``reduce_gradients`` sums them over
        ``plan.ranks`` (or, without a reduction, the factor on them in place): 1 / ranks makes
        the sum an average, and Horovod's op=Sum is n times the average."""
        total = float(self.layout.world.Get_size()) if self.settings.sum_gradients else 1.0
        return total / (plan.ranks if plan is not None else 1)

    def reduce_gradients(self, grads, sum_in_node: Optional[Callable] = None) -> None:
        self.engine.reduce_gradients(grads, sum_in_node)

    def end_step(self, lr: float = 0.0) -> None:
        self.engine.end_step(float(lr))

    # --- extras (before the first step there is nothing to exchange) ---------------------
    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)
        if self._engine is not None:
            self._engine.set_epoch(self._epoch)

    def release(self) -> None:
        """Call before writing the buffers outside a step (see GossipEngine.release)."""
        if self._engine is not None:
            self._engine.release()

    def drain(self) -> None:
        if self._engine is not None:
            self._engine.drain()

    def average_parameters(self) -> None:
        self.engine.average_parameters()

    def consensus(self, lr: float) -> dict:
        return self.engine.consensus(float(lr))

    def metrics(self) -> dict:
        if self._engine is None:
            return {"weight": 1.0, "wait_seconds": 0.0, "total_wait_seconds": 0.0,
                    "bytes_sent": 0, "iteration": 0}
        return self._engine.metrics()

    def state(self) -> dict:
        """PushSum weights, iteration and epoch: the checkpoint contract of every framework."""
        if self._engine is None:  # nothing exchanged yet: the state of step 0
            return {"iteration": self.resume_at, "epoch": self._epoch,
                    "weights": [1.0] * len(self.buffers)}
        return self._engine.checkpoint.state()

    def load_state(self, state: dict) -> None:
        """Restore ``state()`` on this rank (see checkpoint.py for what a rank restores)."""
        self.engine.checkpoint.load(state)
        self._epoch = self.engine.epoch

    def adopt(self, root_state: dict) -> None:
        """After a broadcast of root's ``state()`` (Horovod's recipe, every rank): root's
        shared part, and per-rank state afresh. An engine not started yet (a replacement's,
        or a survivor's successor) starts in step with its peers: nothing to do but the epoch."""
        shared = checkpoint.shared(root_state)
        self._epoch = int(shared.get("epoch", self._epoch))
        if self.started:
            self._engine.checkpoint.adopt(shared)

    @property
    def closed(self) -> bool:
        return self._engine is not None and self._engine.closed

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


class _JoinServer:
    """``join()``'s participant (horovod_api.join) for every SGP session of this process: a
    rank out of data keeps stepping its optimizers with zero gradients, its own parameters
    and its own weight, so the peers' gradient sums count only the ranks with data and their
    gossip rounds find a partner. Sessions are held weakly (a dropped optimizer is not
    served). One dropped in a reference cycle lives on until the cycle collector runs, at
    another moment on each rank, so before a served step join() collects garbage, and every
    rank serves the same ones; a full collection costs 0.1-0.2 s of CPU with torch loaded,
    so where nothing is served (every rank joined at once) it runs only if more than one
    session is left to count the steps of, or one lags the agreed iteration. Only
    running engines are served: after replacements joined, a survivor's engine has stood
    aside and a replacement's has not started, on every rank alike, and each starts at its
    next use (starting one inside join() would be a collective that ranks already answered
    by the coordinator never reach). Several
    optimizers must step equally often: one iteration count is agreed for all."""

    instance: Optional["_JoinServer"] = None

    def __init__(self) -> None:
        self.sessions: list[weakref.ref] = []
        self.collected = False

    @classmethod
    def add(cls, session: "SgpSession") -> None:
        if cls.instance is None:
            cls.instance = cls()
            join.register_join_participant(cls.instance)
        cls.instance.sessions.append(weakref.ref(session))

    def live(self) -> list["SgpSession"]:
        """The running sessions of the optimizers the script still holds (once per join())."""
        if not self.collected:
            gc.collect()
            self.collected = True
        return self.uncollected()

    def uncollected(self) -> list["SgpSession"]:
        """The running sessions, with those of optimizers dropped in a cycle not yet collected."""
        finalizers.run()
        self.sessions = [ref for ref in self.sessions if ref() is not None]
        return [s for s in (ref() for ref in self.sessions)
                if s is not None and s.started and not s.closed]

    def serve(self, poll: Callable[[], object]) -> bool:
        served = False
        for session in self.live():
            served |= session.engine.join.serve(poll)
        return served

    def started_iteration(self) -> int:
        sessions = self.uncollected()  # one: its count is right whether dropped or not
        if len(sessions) > 1:
            sessions = self.live()
        return max([s.engine.join.started_iteration() for s in sessions], default=0)

    def finish(self, last: int, poll: Callable[[], object]) -> None:
        try:
            sessions = self.uncollected()
            if any(s.engine.join.started_iteration() < last for s in sessions):
                sessions = self.live()  # steps to serve: only for the optimizers still held
            for session in sessions:
                session.engine.join.finish(last, poll)
        finally:
            self.collected = False


class GossipMethods:
    """The SGP extras of every DistributedOptimizer; a framework supplies ``_sgp_session``
    and ``_sgp_learning_rate``."""

    def _sgp_session(self) -> SgpSession:
        raise NotImplementedError

    def _sgp_learning_rate(self) -> float:
        raise NotImplementedError

    def synchronize_gossip(self) -> None:
        """Sum in the messages still in flight (Overlap SGP), so evaluation and checkpoints
        see them. Call it on every rank."""
        self._sgp_session().drain()

    def average_parameters(self, model: Any = None) -> None:
        """Exact consensus: every rank gets the network average (for evaluation or saving).
        With ``model``, its floating-point state outside the parameters (BatchNorm running
        means and variances) is averaged exactly too: SGP never mixes it. Call it on every
        rank."""
        self._sgp_session().average_parameters()
        if model is not None:
            self._sgp_average_statistics(model)

    def _sgp_average_statistics(self, model: Any) -> None:
        """Replace the model's floating-point state outside the parameters by its exact
        average over all ranks (node.average_arrays, on the framework's arrays)."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch-based schedule (HVD_SGP_SCHEDULE) which epoch runs."""
        self._sgp_session().set_epoch(epoch)

    def metrics(self) -> dict:
        """Per-rank PushSum weight, seconds waited on peers, bytes sent (no communication)."""
        return self._sgp_session().metrics()

    def consensus_metrics(self) -> dict:
        """One allreduce: this rank's deviation from the network mean, the consensus distance
        and the elastic-consistency estimate (largest deviation seen / learning rate). Call
        it on every rank."""
        return self._sgp_session().consensus(self._sgp_learning_rate())

    def sgp_scalars(self, consensus: bool = True) -> dict:
        """This rank's figures under the names every logger uses (telemetry.LOCAL_SCALARS,
        CONSENSUS_SCALARS); ``consensus`` adds the deviation, consensus distance and
        elastic-consistency estimate (one allreduce: call it on every rank)."""
        return telemetry.scalars(self.metrics(), self.consensus_metrics() if consensus else None)

    def gathered_sgp_scalars(self, consensus: bool = True) -> dict:
        """Every rank's ``sgp_scalars()`` on every rank, as ``name/rank<r>`` (the consensus
        distance once): what a logger on rank 0 writes. A collective of the global process
        set: every rank calls it."""
        rows = collectives.allgather_object(self.sgp_scalars(consensus), name="hvd_sgp.scalars")
        return telemetry.by_rank(rows)

    def sgp_state(self) -> dict:
        """PushSum weights, iteration and epoch, for a checkpoint beside the model's (local;
        torch's ``state_dict()`` carries the same under the key "hvd_sgp")."""
        return self._sgp_session().state()

    def load_sgp_state(self, state: dict) -> None:
        """Restore ``sgp_state()``; every rank calls it."""
        self._sgp_session().load_state(state)


def all_finite(finite: bool) -> bool:
    """True when the gradients were finite on every rank (one allreduce). A loss scaler that
    skips a step must skip it on every rank: otherwise one rank's exchange has no partner and
    the ranks' loss scales drift apart."""
    flag = np.array([1 if finite else 0], dtype=np.int32)
    return bool(collectives.allreduce(flag, ReduceOp.Min)[0])



