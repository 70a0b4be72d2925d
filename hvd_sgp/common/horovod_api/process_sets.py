"""Process sets, as Horovod's: subsets of the ranks that run collectives among themselves.

Every registered set has a communicator of its ranks, in set-rank order
(``process_set_comm``: the hook for layers that run their own traffic on a set, such as a
DistributedOptimizer(process_set=...)), and on its member ranks a negotiation Controller on a
private duplicate of it. Set 0 is the global set. Adding and removing a set is collective
over all ranks and negotiated on the global set, so every rank registers the same sets under
the same ids, or every rank fails with the same error.

After a repair of the world (fault-tolerant mode, world.on_world_change) every set is
dropped and the global set reopened on the survivors: the other sets named ranks by the old
numbering, and some of them are gone (re-add them in an elastic reset callback).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional, Sequence, Union

from hvd_sgp.common import place, recovery
from hvd_sgp.common.errors import CollectiveTimeoutError, NotInitializedError, SgpValueError
from hvd_sgp.common.horovod_api import negotiation
from hvd_sgp.common.horovod_api.negotiation import Controller, Kind, Settings
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.waiting import Wait
from hvd_sgp.common.world import WorldChange, on_world_change, track


class ProcessSet:
    """A set of ranks (global ranks, sorted) or an mpi4py communicator of them. It becomes
    usable once registered by ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set()``,
    which set ``process_set_id``; Horovod's collectives take it as ``process_set=``."""

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], MPI.Comm]):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            ranks = None
        if ranks is None or any(isinstance(r, bool) or not hasattr(r, "__index__")
                                for r in ranks):
            raise SgpValueError("ProcessSet should be initialized with a list of process ranks "
                                f"or an mpi4py Comm object, got {ranks_or_comm!r}")
        self.ranks = sorted(int(r) for r in ranks)

    def size(self) -> Optional[int]:
        """Number of ranks, or None while not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (collectives still take global root ranks), or
        None while not registered or when this process is not in the set."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(place.rank())

    def included(self) -> Optional[bool]:
        """Whether this process is in the set; None while its ranks are unknown."""
        return None if self.ranks is None else place.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Registered(NamedTuple):
    ranks: tuple
    comm: Optional[MPI.Comm]  # the set's communicator; None on ranks outside the set


_sets: dict[int, _Registered] = {}
_objects: dict[int, list[ProcessSet]] = {}  # the user's objects carrying each id
_world: Optional[MPI.Comm] = None  # the runtime's world this layer was started on
_next_id = [1]
_subscription: list = []  # the on_world_change key, once subscribed


def start(settings: Settings) -> None:
    """Open the global set on the runtime's world (collective over every rank; idempotent)."""
    if started():
        return
    stop()
    global _world
    world = place.world_comm()
    n = world.Get_size()
    negotiation.controllers[0] = Controller(_dup(world, settings.timeout), 0, range(n), settings)
    negotiation.set_crowded(place.require().ranks_here() > len(os.sched_getaffinity(0)))
    _sets[0] = _Registered(tuple(range(n)), world)
    global_process_set.ranks = list(range(n))
    _world = world
    if not _subscription:
        _subscription.append(on_world_change(_world_changed))


def _world_changed(change: WorldChange) -> None:
    """A repair replaced the world: drop every set (their communicators held the old
    ranks) and open the global set on the survivors, with the same settings. Called on every
    survivor by runtime.repair, so the collective start lines up; idempotent."""
    ctl = negotiation.controllers.get(0)
    settings = ctl.settings if ctl is not None else Settings.from_environ()
    stop()
    start(settings)


def started() -> bool:
    return _world is not None and place.is_initialized() and place.world_comm() is _world


def stop() -> None:
    """Forget every set and free their communicators (Horovod's shutdown)."""
    global _world
    for sid in list(_sets):
        _drop(sid)
    _world = None
    _next_id[0] = 1
    global_process_set.ranks = []


def ensure_started() -> None:
    """Start on first use when the runtime was started without hvd.init() (e.g. by
    hvd_sgp.DistributedOptimizer); every rank reaches it at its first collective."""
    if not started():
        if not place.is_initialized():
            raise NotInitializedError()
        start(Settings.from_environ())


def controller(process_set: ProcessSet) -> Controller:
    """The negotiation controller of ``process_set`` on this rank, or the clear error."""
    sid = _registered_id(process_set)
    ctl = negotiation.controllers.get(sid)
    if ctl is None:
        raise SgpValueError(f"this rank is not in {process_set}: only its ranks may run "
                            "collectives on it")
    return ctl


def ranks_of(process_set: ProcessSet) -> tuple:
    return _sets[_registered_id(process_set)].ranks


def process_set_comm(process_set: ProcessSet) -> Optional[MPI.Comm]:
    """The communicator of a registered set's ranks (set-rank order), None on ranks outside
    it: for layers that run their own traffic on a set. Collectives never use it directly."""
    return _sets[_registered_id(process_set)].comm


def _registered_id(process_set: Any) -> int:
    ensure_started()
    if not isinstance(process_set, ProcessSet):
        raise SgpValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    sid = process_set.process_set_id
    if sid is None or sid not in _sets:
        raise SgpValueError(f"{process_set} is not registered: pass it to "
                            "hvd.init(process_sets=[...]) or hvd.add_process_set() first "
                            "(or it was removed)")
    return sid


def problem_with(ranks: Sequence[int]) -> str:
    """Why ``ranks`` cannot become a new set ('' when it can)."""
    n = place.size()
    if not ranks:
        return "a process set needs at least one rank"
    if len(set(ranks)) != len(ranks):
        return f"process set ranks {list(ranks)} repeat a rank"
    if ranks[0] < 0 or ranks[-1] >= n:
        return f"process set ranks {list(ranks)} must lie in 0..{n - 1}"
    if find(ranks) is not None:
        return f"Attempted to add a duplicate process set: ranks {list(ranks)} are registered"
    return ""


def find(ranks: Sequence[int]) -> Optional[int]:
    return next((sid for sid, s in _sets.items() if s.ranks == tuple(ranks)), None)


def adopt(process_set: ProcessSet, sid: int) -> None:
    """Give a user's object a registered id (and ranks)."""
    process_set.process_set_id = sid
    process_set.ranks = list(_sets[sid].ranks)
    _objects.setdefault(sid, []).append(process_set)


def world_ranks_of(comm: MPI.Comm) -> list:
    """The global ranks of an mpi4py communicator's members."""
    group, world = comm.Get_group(), place.world_comm().Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    if any(r == MPI.UNDEFINED for r in ranks):
        raise SgpValueError("a ProcessSet communicator must only hold ranks of hvd_sgp's world")
    return sorted(ranks)


def _dup(comm: MPI.Comm, timeout: float) -> MPI.Comm:
    """A private duplicate of ``comm``, waiting for the other ranks under the deadline.

    Tracked (revoked with the world when a peer is lost) only once it is built: a duplicate
    cut short by a lost peer is half built, and Open MPI 5.0 dereferences what it lacks
    when asked to revoke it (a segfault in mca_pml_ob1_revoke_comm, seen in a chaos run); it
    is left to MPI, neither revoked nor freed."""
    new, request = comm.Idup()
    Wait("the start of hvd_sgp's collectives", lambda: "the ranks that have not started them",
         timeout, error=CollectiveTimeoutError, hint="(call hvd.init() on every rank)").until(
             request.Test)
    track(new)
    return new


def _drop(sid: int) -> None:
    ctl = negotiation.controllers.pop(sid, None)
    if ctl is not None:
        ctl.close()
    registered = _sets.pop(sid, None)
    if sid != 0 and registered is not None:
        recovery.free(registered.comm)
    for ps in _objects.pop(sid, []):
        ps.process_set_id = None


class _AddSet(Kind):
    """Every rank registers the set; members split off its communicator."""

    name = "add_process_set"

    def check(self, requests, ctl):
        values = {r: list(q.extra) for r, q in requests.items()}
        if len({q.extra for q in requests.values()}) > 1:
            return f"ranks passed different process sets: {ctl.disagreement(values)}"
        return ""

    def phase(self, op, ctl):
        yield [], False
        ranks = tuple(op.request.extra)
        member = ctl.ranks[ctl.rank] in ranks
        comm = ctl.comm.Split(0 if member else MPI.UNDEFINED, key=ctl.rank)
        sid = _next_id[0]
        _next_id[0] += 1
        if member:
            negotiation.controllers[sid] = Controller(comm.Dup(), sid, ranks, ctl.settings)
        _sets[sid] = _Registered(ranks, comm if member else None)
        return sid


class _RemoveSet(Kind):
    name = "remove_process_set"

    def check(self, requests, ctl):
        values = {r: q.extra[0] for r, q in requests.items()}
        if len(set(values.values())) > 1:
            return f"ranks removed different process sets: {ctl.disagreement(values)}"
        return ""

    def phase(self, op, ctl):
        yield [], False
        _drop(op.request.extra[0])


negotiation.register(_AddSet())
negotiation.register(_RemoveSet())
