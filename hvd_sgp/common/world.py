"""The world as hvd_sgp sees it (``World``): its communicators (all ranks, this rank's node,
the same local rank of every node), its membership (every rank's origin, node and host) and
the hosts it is laid out for. Start-up (runtime.init), a repair (world_repair) and a grow or
change of hosts (world_grow) act on one; ``on_world_change`` tells whoever built
communicators of their own from it that it changed (``WorldChange``).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from hvd_sgp.common import finalizers, planners, recovery, stopped
from hvd_sgp.common.blocking import watched
from hvd_sgp.common.mpi import MPI


class Entry(NamedTuple):
    """One rank as every other knows it, gathered at start-up and at every change."""

    origin: int
    node: Any
    host: str
    process: stopped.Identity  # (so that a peer on its machine can tell it is stopped)


def ranks_on_machine(processes: list, hosts: list, host: str) -> int:
    """How many of the ranks whose processes and hosts are given run on this machine (one
    kernel boot; by ``host``'s name where this machine cannot tell). From the gathered entries:
    no communicator is built for it, so no window where Open MPI 5.0 crashes a survivor that
    learns of a failure (docs/faults.md, session 28)."""
    mine = stopped.identity()
    if mine is None:
        return hosts.count(host)
    return sum(1 for peer in processes if peer is not None and peer[0] == mine[0])


def entry(origin: int, node: Any, host: str) -> Entry:
    """This process's entry, to be gathered by every rank."""
    return Entry(origin, node, host, stopped.identity())


class World:
    """One process's view of the world: what start-up built, and what every change since then
    (a repair, a grow, a resize) made of it."""

    def __init__(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm, thread_level: int,
                 node: Any, origin: int, entries: list, host: str):
        self.world, self.local, self.cross = watched(world), watched(local), watched(cross)
        self.thread_level = thread_level
        self.origin = origin  # the rank at init (a replacement's: new): names a rank for good
        self.node = node  # what makes ranks one node: HVD_SGP_LOCAL_SIZE group or host name
        self.host = host  # the host as the launcher names it (see runtime.host)
        self.replacement = False  # spawned by a repair to replace a lost rank (world_grow.arrive)
        # Host discovery (sgprun --host-discovery-script), alike on every rank: the hosts the
        # world is laid out for, a change agreed at a commit and not yet applied (resize), and
        # the hosts the MPI runtime knows (others are added when a rank is spawned there).
        self.discovered: Optional[list] = None
        self.pending: Optional[list] = None
        self.allocated: set = set()
        # HVD_SGP_REPLACE_AT ready or commit: the seats of the world before its first loss whose
        # replacement has not joined yet (world_grow.replace), alike on every rank; else None.
        self.vacated: Optional[dict] = None
        self.vacated_at = 0.0  # (time.monotonic() of the loss that set it, on this rank)
        self.next_origin = 0
        self._lock = threading.Lock()  # the watchdog thread revokes while a repair installs
        self._closed = False
        self.remember(entries)

    def remember(self, entries: list) -> None:
        """Every rank's ``Entry``, by current rank: what a repair needs to know of the ranks it
        lost (their slots, nodes and hosts) to put replacements there."""
        self.origins = [e.origin for e in entries]
        self.nodes = [e.node for e in entries]
        self.hosts = [e.host for e in entries]
        self.processes = [e.process for e in entries]
        self.next_origin = max(self.next_origin, max(self.origins) + 1)

    def entry(self) -> Entry:
        """This rank's, as ``remember`` takes them from every rank."""
        return entry(self.origin, self.node, self.host)

    def peers(self) -> list:
        """(origin, process) of every rank, for the stopped-peer sentinel (stopped.py)."""
        return list(zip(self.origins, self.processes))

    def seats(self) -> dict:
        """origin -> (rank, node, host) of every rank of the world as it stands."""
        return planners.seats(self.origins, self.nodes, self.hosts)

    def install(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm, entries: list) -> None:
        """Take new communicators and membership; the old communicators are freed."""
        with self._lock:
            old = (self.world, self.local, self.cross)
            self.world, self.local, self.cross = watched(world), watched(local), watched(cross)
            self.remember(entries)
        for comm in old:
            recovery.free(comm)

    def revoke_all(self) -> None:
        """Revoke the world, node and cross communicators and every tracked one, so every rank
        blocked on any of them learns of the failure (ULFM's MPI_Comm_revoke)."""
        with self._lock:
            if self._closed:
                return
            comms = [self.world, self.local, self.cross, *_tracked]
        for comm in comms:
            revoke(comm)

    def ranks_here(self) -> int:
        """How many ranks of the world run on this rank's machine (see ``ranks_on_machine``)."""
        return ranks_on_machine(self.processes, self.hosts, self.host)

    def revoked(self) -> bool:
        with self._lock:
            return not self._closed and self.world.Is_revoked()

    def lost_peer(self) -> bool:
        """Whether ULFM reports a member of the world failed, or the world revoked (no
        communication: what this process has learnt so far)."""
        with self._lock:
            if self._closed:
                return False
            if self.world.Is_revoked():
                return True
            failed = self.world.Get_failed()
            try:
                return failed.Get_size() > 0
            finally:
                failed.Free()

    def close(self) -> None:
        """Free the communicators (runtime.shutdown); nothing is revoked after."""
        with self._lock:
            self._closed = True
            comms = (self.cross, self.local, self.world)
        for comm in comms:
            recovery.free(comm)


def revoke(comm: MPI.Comm) -> None:
    """Revoke ``comm`` unless it is already (ULFM); an error here (a communicator freed or
    broken under us) changes nothing: the failure is being handled already."""
    try:
        if not comm.Is_revoked():
            comm.Revoke()
    except MPI.Exception:
        pass


def regroup(world: MPI.Comm, nodes: list) -> tuple[MPI.Comm, MPI.Comm]:
    """The node and cross-node communicators of ``world`` after ranks left or joined
    (``planners.node_colors``); ``nodes``: each rank's node key, by rank."""
    me = world.Get_rank()
    local = world.Split(planners.node_colors(nodes)[me], key=me)
    return local, world.Split(local.Get_rank(), key=me)


_tracked: list = []  # private communicators derived from the world (the transports')


def track(comm: MPI.Comm) -> None:
    """A private communicator derived from the world: revoked with it when a peer is lost."""
    _tracked.append(comm)


def untrack(comm: MPI.Comm) -> None:
    if comm in _tracked:
        _tracked.remove(comm)


def free_tracked() -> None:
    """Free every tracked communicator, at exit (runtime._release)."""
    while _tracked:
        recovery.free(_tracked.pop())


# --- telling the subscribers -----------------------------------------------------------------
@dataclass(frozen=True)
class WorldChange:
    """What a repair, grow or resize hands every ``on_world_change`` subscriber."""

    world: MPI.Comm  # the survivors (also runtime.world_comm() from now on)
    local: MPI.Comm  # this rank's node, re-formed (see regroup)
    cross: MPI.Comm  # the same local rank of every node
    lost: tuple  # the ranks gone, named by their rank at init (origin_rank)
    size_before: int
    realign: bool  # repaired inside a step: optimizers realign their steps (see engine)
    joined: tuple = ()  # replacements taken in (their origins); nothing was lost then
    spares: int = 0  # how many of them were warm spares (spares.py), not spawned for it


_subscribers: dict = {}  # key -> weak reference to the callback, in registration order
_next_key = [0]


def on_world_change(callback: Callable[[WorldChange], None]) -> int:
    """Call ``callback(change)`` after every repair, with the new communicators; returns a key
    for ``forget_world_change``. Bound methods are held weakly.

    The subscriber contract: the old communicators are revoked and freed, so drop every request
    in flight on them without waiting and build your own communicators from ``change`` again
    (collectively: every survivor calls the subscribers alive on all of them, in registration
    order); raise PeerLostError if communication fails (the repair then starts over and calls
    you again, so be idempotent). Register at the same point on every rank.
    """
    key = _next_key[0]
    _next_key[0] += 1
    _subscribers[key] = (weakref.WeakMethod(callback) if hasattr(callback, "__self__")
                         else (lambda: callback))
    return key


def forget_world_change(key: int) -> None:
    _subscribers.pop(key, None)


def notify(change: WorldChange) -> None:
    """Call the subscribers alive on every rank of ``change.world`` (a key collected on some
    rank is gone for good), in registration order."""
    finalizers.run()  # the optimizers collected so far unsubscribe first
    alive = []
    for key, ref in list(_subscribers.items()):
        callback = ref()
        if callback is None:
            _subscribers.pop(key)
        else:
            alive.append((key, callback))
    if change.joined:  # the replacements have no subscribers; the survivors agreed just now
        everywhere = {key for key, _ in alive}
    else:
        everywhere = set.intersection(*(set(keys) for keys in
                                        change.world.allgather([key for key, _ in alive])))
    for key, callback in alive:
        if key in everywhere:
            callback(change)
        else:  # collected on some rank: gone for good
            _subscribers.pop(key, None)
    if change.joined:
        _renumber()


def _renumber() -> None:
    """After replacements joined: the keys that remain (the optimizers' engines retired) are
    numbered from 0, as a replacement numbers its own from init(), so that the subscribers
    registered from here on, in the same order everywhere, get the same keys everywhere
    (``notify`` agrees on the keys)."""
    remaining = list(_subscribers.values())
    _subscribers.clear()
    _subscribers.update(enumerate(remaining))
    _next_key[0] = len(remaining)
