"""What an engine does when its world changes (fault-tolerant mode): the fold over the
survivors, the realignment of a plain script's loop, and standing aside when replacements
join. (recovery.py turns a lost peer into PeerLostError; runtime.repair rebuilds the world and
calls ``Repair.world_changed``, subscribed through world.on_world_change.)

It works through the engine's public parts: ``stop_progress``, ``connect``, ``restage``,
``fold``, ``live`` and ``guard``; its ``transport``, ``mixers``, ``buffers``, ``world`` and
``local``, ``steps``, ``epoch``, ``calls`` and ``in_call``, ``meet_at`` (the call where the
realigned survivors meet, which the step reads), ``outer``, ``optimizer_state``, ``stage``,
``repairs``, ``retired`` and ``closed``; and ``engine.checkpoint.restart``.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from hvd_sgp.common.arrays import kit_for
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.node import average_arrays
from hvd_sgp.common.world import WorldChange, forget_world_change, on_world_change

if TYPE_CHECKING:
    from hvd_sgp.common.engine import GossipEngine


class Repair:
    """The world-change side of one engine (``engine.repair``); subscribes on creation."""

    def __init__(self, engine: "GossipEngine"):
        self.engine = weakref.proxy(engine)  # (the engine holds this one: no cycle)
        self._subscription = on_world_change(self.world_changed)

    def unsubscribe(self) -> None:
        forget_world_change(self._subscription)

    def world_changed(self, change: WorldChange) -> None:
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
        self.engine.join.abandon()
        if change.joined:
            self.retire(change)
            return
        engine = self.engine

        def repair() -> None:
            began = time.monotonic()
            engine.stop_progress()
            _abandon(engine)
            entry_weights = [m.entry_weights() for m in engine.mixers]
            engine.transport.free()
            engine.connect(change.world, change.local, change.cross)
            resume = engine.calls + (2 if engine.in_call else 1)
            agreed = np.array([engine.steps, resume], dtype=np.int64)
            engine.world.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
            steps, meet = agreed.tolist()
            engine.steps = steps
            engine.meet_at = meet if change.realign else 0
            engine.restage()
            held = self._mass()
            engine.fold(entry_weights)
            engine.outer.load_state(None)  # the fold replaced every anchor's model: start afresh
            if engine.stage.mode == "allreduce":
                average_arrays(list(engine.optimizer_state()), engine.world)
            engine.repairs.append({"lost": list(change.lost), "size": engine.world.Get_size(),
                                   "iteration": engine.steps, "held": held,
                                   "after": self._mass(), "skipped_to": engine.meet_at,
                                   "seconds": time.monotonic() - began})
        engine.live(repair)

    def retire(self, change: WorldChange) -> None:
        """Replacements joined the world (runtime._grow), right after the repair's fold made
        every survivor's weight 1 and its parameters the survivors' exact average. A
        replacement starts its engine at its first use of the optimizer, a collective; this
        survivor's session starts a successor engine at that same point (``succeeds``), so
        this one stands aside without communicating: nothing is in flight after the fold,
        and the weight stays 1. With the replacements' weight 1 and their parameters synced
        from rank 0 (hvd.elastic's ``state.sync()``), the world's total weight is its size
        and the de-biased average is the survivors' fold, unchanged."""
        engine = self.engine
        engine.stop_progress()
        _abandon(engine)
        engine.mixers = []
        engine.transport.free()
        self.unsubscribe()
        engine.repairs.append({"joined": list(change.joined), "size": change.world.Get_size(),
                               "iteration": engine.steps})
        engine.retired = engine.closed = True  # (its timeline goes on in the successor)

    def reset_weights(self) -> None:
        """After the parameters were made identical on every rank from outside (hvd.elastic's
        sync broadcasts rank 0's model), drop the messages in flight and set every PushSum
        weight to 1: the exact state of a consensus. Call it on every rank."""
        engine = self.engine

        def reset() -> None:
            _abandon(engine)
            steps = np.array([engine.steps], dtype=np.int64)
            engine.world.Allreduce(MPI.IN_PLACE, steps, op=MPI.MAX)  # (not .allreduce: mpi.py)
            engine.checkpoint.restart(int(steps[0]), engine.epoch, engine.outer.state())
        engine.guard(reset, "resetting the PushSum weights")

    def _mass(self) -> list:
        """The survivors' PushSum mass, summed over ranks: [sum of w * z over every parameter,
        sum of w] per buffer (one allreduce; for the repair ledger)."""
        engine = self.engine
        local = [x for buf in engine.buffers
                 for x in (float(buf[-1]) * kit_for(buf).total(buf[:-1]), float(buf[-1]))]
        if engine.local.Get_size() > 1:  # one copy per node: count it once
            local = [x if engine.local.Get_rank() == 0 else 0.0 for x in local]
        total = np.array(local, dtype=np.float64)
        engine.world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total.tolist()


def _abandon(engine: "GossipEngine") -> None:
    """Drop every exchange in flight without waiting (each mixer de-biases as it stands)."""
    for mixer in engine.mixers:
        mixer.abandon()
