"""MPI start-up and the rank layout: world, node-local and cross-node communicators; in
fault-tolerant mode, the world's repair after a lost rank.

A node is the set of ranks that share memory (an MPI shared-memory split); SGP gossips between
nodes and averages exactly inside one. ``HVD_SGP_LOCAL_SIZE=L`` groups consecutive ranks into
nodes of L ranks instead, so one machine can emulate several nodes.

After a repair (``repair``) the world holds the survivors, ``rank()``/``size()`` report the new
world, and whatever built communicators of its own from the old one rebuilds them in a
callback registered with ``on_world_change``.
"""
from __future__ import annotations

import atexit
import functools
import math
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hvd_sgp.common import fault_record, options, recovery
from hvd_sgp.common.errors import (NotInitializedError, OptionError, PeerLostError,
                                   PeerTimeoutError, SgpError, SgpValueError)
from hvd_sgp.common.mpi import MPI


@dataclass(frozen=True)
class Launcher:
    """Who started this process, as far as the environment tells."""

    name: str  # "openmpi", "mpich", "slurm", "horovodrun" or "none"
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int]


_LAUNCHER_VARS = (
    # (name, rank, size, local rank); first match wins, horovodrun sets its own on top of mpirun's.
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def detect_launcher(environ: Optional[dict] = None) -> Launcher:
    """Name the launcher from its environment variables (diagnostics and sgprun)."""
    env = os.environ if environ is None else environ

    def read(key: str) -> Optional[int]:
        value = env.get(key)
        return int(value) if value is not None and value.strip().isdigit() else None

    for name, rank_key, size_key, local_key in _LAUNCHER_VARS:
        if rank_key in env:
            return Launcher(name, read(rank_key), read(size_key), read(local_key))
    return Launcher("none", None, None, None)


class _State:
    def __init__(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm, thread_level: int,
                 node: Any):
        self.world = world
        self.local = local
        self.cross = cross
        self.thread_level = thread_level
        self.origin = world.Get_rank()  # the rank at init: names a rank across repairs
        self.origins = list(range(world.Get_size()))  # every rank's origin, by current rank
        self.node = node  # what makes ranks one node: HVD_SGP_LOCAL_SIZE group or host name


_state: Optional[_State] = None
_lock = threading.Lock()  # the watchdog thread reads the world while a repair replaces it
_tracked: list = []  # private communicators derived from the world (the transports')


def _local_split(world: MPI.Comm) -> tuple[MPI.Comm, Any]:
    """The node-local communicator, and the key that names this rank's node."""
    local_size = options.from_environment("local_size")
    if local_size is None:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        return local, MPI.Get_processor_name()
    if world.Get_size() % local_size:
        raise OptionError(f"HVD_SGP_LOCAL_SIZE={local_size} must divide the number of ranks "
                            f"({world.Get_size()})")
    node = world.Get_rank() // local_size
    return world.Split(node, key=world.Get_rank()), node


def init(comm: Optional[MPI.Comm] = None) -> None:
    """Start MPI (thread level MULTIPLE requested) and build the communicators; idempotent.

    ``comm`` restricts hvd_sgp to a sub-communicator, as Horovod's ``init(comm=...)`` does.
    """
    global _state
    if _state is not None:
        return
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    world = (MPI.COMM_WORLD if comm is None else comm).Dup()
    local, node = _local_split(world)
    parts = _layout(world, local)
    _state = _State(world, local, parts.cross, MPI.Query_thread(), node)
    recovery.configure(_world_revoked, _state.origin)
    _abort_on_uncaught_errors()


@dataclass(frozen=True)
class Layout:
    """A group of ranks as SGP sees it: all of them, this rank's node, and the ranks with this
    local rank on every node (the whole world, or a Horovod process set's ranks)."""

    world: MPI.Comm
    local: MPI.Comm
    cross: MPI.Comm


def split(world: MPI.Comm) -> Layout:
    """Nodes and cross-node groups of ``world`` (collective over it; ``world`` is kept)."""
    return _layout(world, _local_split(world)[0])


def _layout(world: MPI.Comm, local: MPI.Comm) -> Layout:
    cross = world.Split(local.Get_rank(), key=world.Get_rank())
    sizes = world.allgather(local.Get_size())
    if len(set(sizes)) != 1:
        raise SgpValueError(
            f"nodes have different numbers of ranks {sorted(set(sizes))}; hvd_sgp needs the same "
            "number of ranks on every node (or set HVD_SGP_LOCAL_SIZE)"
        )
    return Layout(world, local, cross)


def layout() -> Layout:
    """The world's layout."""
    state = _require()
    return Layout(state.world, state.local, state.cross)


def shutdown() -> None:
    """Release the communicators; a later init() starts afresh. MPI itself ends at exit."""
    global _state
    if _state is None:
        return
    with _lock:
        comms, _state = (_state.cross, _state.local, _state.world), None
    for comm in comms:
        _free(comm)


def _free(comm: MPI.Comm) -> None:
    """Free a communicator; one a failure revoked may refuse, and is then left to MPI."""
    if MPI.Is_finalized():
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass


atexit.register(shutdown)


def is_initialized() -> bool:
    return _state is not None


def _require() -> _State:
    if _state is None:
        raise NotInitializedError()
    return _state


def world_comm() -> MPI.Comm:
    return _require().world


def local_comm() -> MPI.Comm:
    return _require().local


def cross_comm() -> MPI.Comm:
    return _require().cross


def rank() -> int:
    return _require().world.Get_rank()


def origin_rank() -> int:
    """This rank's rank at init(): how logs and errors name it across repairs."""
    return _require().origin


def size() -> int:
    return _require().world.Get_size()


def local_rank() -> int:
    return _require().local.Get_rank()


def local_size() -> int:
    return _require().local.Get_size()


def cross_rank() -> int:
    return _require().cross.Get_rank()


def cross_size() -> int:
    return _require().cross.Get_size()


def mpi_threads_supported() -> bool:
    """True when MPI granted THREAD_MULTIPLE (needed for overlapped gossip)."""
    return _require().thread_level >= MPI.THREAD_MULTIPLE


def mpi_library() -> str:
    """The MPI implementation's own version line."""
    return MPI.Get_library_version().strip().splitlines()[0]


def cuda_aware_mpi() -> bool:
    """Whether MPI can take CUDA buffers directly.

    ``HVD_SGP_CUDA_AWARE=0/1`` decides when set; otherwise the loaded MPI library is asked at
    run time (Open MPI's ``MPIX_Query_cuda_support``). An MPI without that query (MPICH) counts
    as not CUDA-aware: CUDA tensors are then staged through host memory.
    """
    forced = os.environ.get("HVD_SGP_CUDA_AWARE")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    return _mpi_reports_cuda()


@functools.cache
def _mpi_reports_cuda() -> bool:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    except OSError:
        return False
    for path in sorted(libraries):
        try:
            return bool(ctypes.CDLL(path).MPIX_Query_cuda_support())
        except (OSError, AttributeError):
            continue
    return False


def _abort_on_uncaught_errors() -> None:
    """An exception escaping one rank ends the whole job (MPI_Abort) instead of leaving its
    peers blocked forever and the rank itself stuck in MPI_Finalize at exit. In fault-tolerant
    mode only this rank leaves (exit 1, no MPI_Finalize) and the others repair without it."""
    previous = sys.excepthook
    if getattr(previous, "hvd_sgp_abort", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        if recovery.enabled():
            recovery.leave()
        if not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)

    hook.hvd_sgp_abort = True
    sys.excepthook = hook


# --- fault tolerance: the world's repair ------------------------------------------------------
@dataclass(frozen=True)
class WorldChange:
    """What a repair hands every ``on_world_change`` subscriber."""

    world: MPI.Comm  # the survivors (also runtime.world_comm() from now on)
    local: MPI.Comm  # this rank's node, re-formed (see _regroup)
    cross: MPI.Comm  # the same local rank of every node
    lost: tuple  # the ranks gone, named by their rank at init (origin_rank)
    size_before: int
    realign: bool  # repaired inside a step: optimizers realign their steps (see engine)


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


def track(comm: MPI.Comm) -> None:
    """A private communicator derived from the world: revoked with it when a peer is lost."""
    _tracked.append(comm)


def untrack(comm: MPI.Comm) -> None:
    if comm in _tracked:
        _tracked.remove(comm)


def revoke_all() -> None:
    """Revoke the world, node and cross communicators and every tracked one, so every rank
    blocked on any of them learns of the failure (ULFM's MPI_Comm_revoke)."""
    with _lock:
        if _state is None:
            return
        comms = [_state.world, _state.local, _state.cross, *_tracked]
    for comm in comms:
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except MPI.Exception:
            pass


def _world_revoked() -> bool:
    with _lock:
        return _state is not None and _state.world.Is_revoked()


def repair(realign: bool = True) -> WorldChange:
    """Repair the world in place after a lost rank (fault-tolerant mode); every survivor calls
    it, from wherever it noticed the failure.

    1. Revoke every hvd_sgp communicator (late ranks learn at their next MPI call).
    2. Shrink the world to its survivors (ULFM's agreement inside MPI_Comm_shrink gives every
       survivor the same communicator); the lost ranks are the difference.
    3. Re-form the nodes and the cross-node communicators (``_regroup``).
    4. Call the ``on_world_change`` subscribers (optimizers rebuild their graph and fold their
       PushSum state). A failure during 2-4 starts over at 1.
    Fewer survivors than HVD_SGP_MIN_NP end the job with an SgpError on every survivor.
    """
    state = _require()
    began = time.monotonic()
    deadline = began + recovery.repair_deadline()
    before = list(state.origins)  # a failed attempt shrinks too: name all lost since here
    with recovery.repairing(deadline):
        while True:
            revoke_all()
            try:
                with recovery.translated("the repair of the world"):
                    change = _rebuild(state, before, realign)
                    _notify(change)
                break
            except PeerLostError:
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"the world could not be repaired within "
                                           f"{recovery.repair_deadline():.0f} s") from None
    fault_record.write("lost " + ",".join(map(str, change.lost)), state.origin)
    if change.world.Get_rank() == 0:
        print(f"hvd_sgp: lost rank(s) {list(change.lost)}; {change.world.Get_size()} of "
              f"{change.size_before} ranks go on after a repair of "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
    return change


def _rebuild(state: _State, before: list, realign: bool) -> WorldChange:
    survivors = state.world.Shrink()  # (Ishrink fails on a revoked world in Open MPI 5.0)
    entries = survivors.allgather((state.origin, state.node))
    lost = tuple(sorted(set(before) - {origin for origin, _ in entries}))
    minimum = options.from_environment("min_np")
    if survivors.Get_size() < minimum:
        raise SgpError(f"only {survivors.Get_size()} ranks survive (lost {list(lost)}), fewer "
                       f"than HVD_SGP_MIN_NP={minimum}: the job ends")
    local, cross = _regroup(survivors, entries)
    with _lock:
        old = (state.world, state.local, state.cross)
        state.world, state.local, state.cross = survivors, local, cross
        state.origins = [origin for origin, _ in entries]
    for comm in old:
        _free(comm)
    return WorldChange(survivors, local, cross, lost, len(before), realign)


def _regroup(world: MPI.Comm, entries: list) -> tuple[MPI.Comm, MPI.Comm]:
    """Nodes of the survivors: each node keeps its surviving ranks, cut into groups of the
    largest size that divides every node (SGP's shards need the same number of ranks on every
    node), so a node that lost one of two ranks makes every rank its own node."""
    nodes: dict = {}
    for r, (_, node) in enumerate(entries):
        nodes.setdefault(node, []).append(r)
    group = math.gcd(*(len(members) for members in nodes.values()))
    me = world.Get_rank()
    widest = max(len(members) for members in nodes.values())
    color = next(index * widest + members.index(me) // group
                 for index, members in enumerate(sorted(nodes.values()))
                 if me in members)
    local = world.Split(color, key=me)
    return local, world.Split(local.Get_rank(), key=me)


def _notify(change: WorldChange) -> None:
    alive = []
    for key, ref in list(_subscribers.items()):
        callback = ref()
        if callback is None:
            _subscribers.pop(key)
        else:
            alive.append((key, callback))
    everywhere = set.intersection(*(set(keys) for keys in
                                    change.world.allgather([key for key, _ in alive])))
    for key, callback in alive:
        if key in everywhere:
            callback(change)
        else:  # collected on some rank: gone for good
            _subscribers.pop(key, None)
