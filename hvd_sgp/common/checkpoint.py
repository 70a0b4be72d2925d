"""The checkpoint contract of an SGP optimizer: which part of its state every rank shares and
which part belongs to one rank, and the agreement that finds ranks out of step.

Shared (equal on every rank whenever the ranks are in step): the iteration (the graph's
position and the schedule's stage), the epoch, the outer optimizer's state (SlowMo, DiLoCo:
taken on exactly averaged models; over gossip each node's own, and root's is then as good as
any). Horovod's recipe (rank 0 loads, then ``broadcast_optimizer_state``) gives
every rank root's shared part.

Per rank: the PushSum weights, compressed gossip's public copies (error feedback lives in
them) and random-k's run weights. They are exact only together with the same rank's
parameters and its peers' per-rank state, so they are restored only from the same rank's
checkpoint of the same world, and only when every rank restores its own; anywhere else every
rank starts them afresh (weight 1, copies opened anew by the next exact message), which is a
consistent SGP state for any parameters.

``EngineCheckpoint`` is that contract on one engine (``engine.checkpoint``): it reads and
restores through the engine's ``guard``, ``restage``, ``wait``, its ``mixers``, ``buffers``,
``steps``, ``epoch``, ``outer``, ``codec``, ``world`` and ``local``, and sets ``meet_at``
back to none (a restored position has no realignment pending).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from hvd_sgp.common import blocking, watchdog
from hvd_sgp.common.errors import ConsistencyError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.pushsum import PushSumMixer, drain

if TYPE_CHECKING:
    from hvd_sgp.common.engine import GossipEngine

SHARED = ("iteration", "epoch", "outer", "slowmo")  # (slowmo: the outer state's older name)
AGREEMENT = "the agreement on the iteration"
STUCK_SECONDS = 2.0  # a rank inside another part of the engine's step this long never joins
HINT = ("a checkpoint was loaded on some ranks only, or the ranks' checkpoints are of "
        "different steps. Horovod's recipe loads it on rank 0 and then calls "
        "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank; per-rank "
        "checkpoints (optimizer.state_dict() of each rank) are loaded on every rank")


def shared(state: dict) -> dict:
    """The part of ``state`` that every rank takes from root under Horovod's recipe."""
    return {key: state[key] for key in SHARED if key in state}


def own(state: dict, rank: int, size: int) -> bool:
    """Whether ``state`` was saved by this rank of a world of this size with nothing in
    flight, so that its per-rank part can be restored exactly (a checkpoint of before these
    records counts as its own, as it always did)."""
    return (state.get("rank", rank) == rank and state.get("size", size) == size
            and bool(state.get("settled", True)))


def agree(comm: MPI.Comm, steps: int, restored: bool,
          wait: Callable[[MPI.Request, str], None]) -> bool:
    """One non-blocking allgather (``wait`` bounds it): every rank must be at the same
    iteration, else ConsistencyError on every rank naming each rank's iteration. Returns
    whether per-rank state must start afresh everywhere: some ranks restored their own and
    others did not (their peers' copies and weights would not match)."""
    mine = np.array([steps, int(restored)], dtype=np.int64)
    everyone = np.empty(2 * comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(mine, everyone), "agreement on the iteration")
    steps_of, restored_of = everyone[0::2].tolist(), everyone[1::2].tolist()
    if len(set(steps_of)) > 1:
        where = ", ".join(f"rank {r} at iteration {s}" for r, s in enumerate(steps_of))
        raise ConsistencyError(f"ranks are at different iterations ({where}): {HINT}")
    return len(set(restored_of)) > 1


def out_of_step(serial: int, members: Optional[list]) -> Callable[[], None]:
    """The agreement's probe (a roll call, see watchdog.ask): a rank of the engine's world
    that has been inside another part of the same engine's step (``serial``) for
    STUCK_SECONDS will not join the agreement: it did not load, or it runs its loop at
    another step. Then every rank's position is named at once, instead of after
    HVD_SGP_TIMEOUT. (Without a roll call, in fault-tolerant mode, the timeout stays.)"""
    def probe() -> None:
        answers = watchdog.ask()
        if answers is None or members is None:
            return
        answers = {rank: answer for rank, answer in answers.items() if rank in members}
        if any(_inside(answer, serial) and answer.what != AGREEMENT
               and answer.seconds >= STUCK_SECONDS for answer in answers.values()):
            where = ", ".join(f"rank {rank} {_where(answer, serial)}"
                              for rank, answer in sorted(answers.items()))
            raise ConsistencyError(f"ranks are out of step ({where}): {HINT}")
    return probe


def _inside(answer, serial: int) -> bool:
    return (isinstance(answer, watchdog.Status) and answer.owner == serial
            and answer.iteration is not None)


def _where(answer, serial: int) -> str:
    if _inside(answer, serial):
        return f"at iteration {answer.iteration} ({answer.what})"
    return watchdog.in_words(answer)


def check_consistent(comm: MPI.Comm, signature: list, opts: tuple, iteration: int = 0,
                     serial: int = 0) -> tuple[int, int]:
    """One allgather at an engine's start: every rank must have the same parameters (count,
    shapes, dtypes, order) and the same SGP options; otherwise raise on every rank naming
    those that differ. Returns the largest ``iteration`` given (where the graph starts: a
    replacement joins survivors that are further on) and the largest ``serial`` (the engine's
    name, equal on every rank of ``comm``, however many engines each rank made before)."""
    everyone = comm.allgather((signature, opts, iteration, serial))
    for what, index in (("parameters (names, shapes, dtypes, order)", 0), ("SGP options", 1)):
        differ = [r for r, entry in enumerate(everyone) if entry[index] != everyone[0][index]]
        if differ:
            detail = _first_difference(everyone[0][index], everyone[differ[0]][index])
            raise ConsistencyError(f"ranks {differ} have different {what} from rank 0: "
                                   f"{detail}")
    return max(entry[2] for entry in everyone), max(entry[3] for entry in everyone)


def _first_difference(a, b) -> str:
    if len(a) != len(b):
        return f"{len(b)} entries against rank 0's {len(a)}"
    for x, y in zip(a, b):
        if x != y:
            return f"{y!r} where rank 0 has {x!r}"
    return "differ"


class EngineCheckpoint:
    """The checkpoint side of one engine: ``state()``, ``load()``, ``adopt()``, and the
    agreement on the position at the next step after any of them (or a start)."""

    def __init__(self, engine: "GossipEngine"):
        self.engine = weakref.proxy(engine)  # (the engine holds this one: no cycle)
        self._check_position = True  # agree on the iteration at the next step
        self._restored = False  # this rank's own per-rank state was loaded (exact resume)

    def state(self) -> dict:
        """The checkpoint contract of both frameworks. Local: Horovod's recipe calls it on
        rank 0 alone. Messages in flight (Overlap SGP) are summed in where that needs no
        other rank of the node; otherwise the state says it is not settled, and its per-rank
        part is not restored (``synchronize_gossip()`` on every rank first makes it exact)."""
        engine = self.engine

        def read() -> dict:
            live = not engine.retired  # (a retired engine's communicators went with its world)
            if live and engine.local.Get_size() == 1:
                drain(engine.mixers)  # point to point only: the peers' sends are posted
            state = {"iteration": engine.steps, "epoch": engine.epoch,
                     "weights": [float(b[-1]) for b in engine.buffers],
                     "rank": engine.world.Get_rank() if live else None,
                     "size": engine.world.Get_size() if live else None,
                     "settled": not _in_flight(engine.mixers) and not engine.outer.pending}
            if engine.outer.step is not None:
                state["outer"] = engine.outer.state()
            if engine.codec.differential:
                state["compressed"] = [m.state() for m in engine.mixers]
            return state
        return engine.guard(read, "reading the SGP state")

    def load(self, state: dict) -> None:
        """Restore ``state()`` on this rank (no communication). The per-rank part only from
        this rank's own checkpoint of this world (``own``); the ranks compare where they are
        at the next step."""
        engine = self.engine
        weights = state["weights"]
        if len(weights) != len(engine.buffers):
            raise SgpValueError(f"checkpoint has {len(weights)} PushSum buffers, this model "
                                f"has {len(engine.buffers)}")
        mine = own(state, engine.world.Get_rank(), engine.world.Get_size())

        def load() -> None:
            if _in_flight(engine.mixers):  # (a new optimizer has none: no other rank needed)
                drain(engine.mixers)
            self.restart(int(state["iteration"]), int(state.get("epoch", 0)),
                         state.get("outer", state.get("slowmo")))  # (SlowMo's older name)
            if not mine:
                return
            for buf, w in zip(engine.buffers, weights):
                buf[-1] = w
            for mixer, copies in zip(engine.mixers, state.get("compressed", ())):
                mixer.load_state(copies)
            self._restored = True
        engine.guard(load, "loading the SGP state")

    def adopt(self, shared: dict) -> None:
        """Horovod's recipe, after root's parameters reached every rank: take root's shared
        state (``shared()``) and start the per-rank state afresh, weight 1 and no copies: the
        exact state of a consensus. Every rank calls it, at one point of its loop."""
        engine = self.engine

        def adopt() -> None:
            drain(engine.mixers)
            self.restart(int(shared.get("iteration", engine.steps)),
                         int(shared.get("epoch", engine.epoch)),
                         shared.get("outer", shared.get("slowmo")))
        engine.guard(adopt, "adopting root's SGP state")

    def restart(self, steps: int, epoch: int, outer: Optional[dict]) -> None:
        """Stand at iteration ``steps`` with nothing in flight, weight 1 and fresh mixers
        (restoring, not switching: nothing to average); check the position at the next step."""
        engine = self.engine
        engine.steps, engine.epoch = steps, epoch
        for buf in engine.buffers:
            buf[-1] = 1
        engine.meet_at = 0
        engine.restage()
        engine.outer.load_state(outer)
        engine.local_updates.restart()
        self._restored, self._check_position = False, True

    def agree(self) -> None:
        """Once after a start, a load or a broadcast: every rank at the same iteration, or
        one error on every rank naming where each stands (instead of a timeout at the first
        exchange); per-rank state restored on some ranks only starts afresh everywhere."""
        if not self._check_position:
            return
        self._check_position = False
        engine = self.engine
        probe = out_of_step(engine.serial, watchdog.names_in(engine.world))

        def wait(request: MPI.Request, what: str) -> None:
            with blocking.doing(AGREEMENT, engine.steps, engine.serial):
                engine.wait(request, what, engine.world, probe)
        if agree(engine.world, engine.steps, self._restored, wait):
            self.restart(engine.steps, engine.epoch, engine.outer.state())
            self._check_position = False


def _in_flight(mixers: Sequence[PushSumMixer]) -> bool:
    """Whether an Overlap SGP exchange is still under way."""
    return any(getattr(m, "in_flight", None) for m in mixers)
