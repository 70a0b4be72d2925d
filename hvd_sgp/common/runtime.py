"""MPI start-up and shutdown, and the world's changes: the public face of the world. The
world (world.py: communicators and membership) is built here and installed in place.py, which
holds this rank's place in it (rank, size, node, layout) for every layer; those, and the
world's change API, are re-exported here.

After a repair (``repair``, world_repair.py) the world holds the survivors, ``rank()``/``size()``
report the new world, and whatever built communicators of its own from the old one rebuilds
them in a callback registered with ``on_world_change``. With HVD_SGP_MAX_NP the repair then
grows the world back with spawned replacements (world_grow.grow); a replacement's ``init()``
is its side of that (world_grow.arrive). With host discovery, ``hosts_changed`` and
``resize`` (world_grow.py) lay the world out for the discovered hosts. Who goes where in each
change is planned in planners.py, without MPI.
"""
from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from hvd_sgp.common import (discovery, fault_mode, finalizers, options, place, recovery,
                            spares, watchdog, world_grow, world_repair)
from hvd_sgp.common.errors import OptionError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.world import World, WorldChange, entry, free_tracked
# This rank's place (place.py) and the world's change API (world.py) are reached as runtime.*
# by the adapters, tests and tools, as the rest of the world's public face.
from hvd_sgp.common.place import (Layout, cross_comm, cross_rank, cross_size, host,  # noqa: F401
                                  is_initialized, layout, local_comm, local_rank, local_size,
                                  mpi_threads_supported, origin_rank, rank, replacement, size,
                                  split, world_comm)
from hvd_sgp.common.world import forget_world_change, on_world_change, track, untrack  # noqa: F401


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


def init(comm: Optional[MPI.Comm] = None) -> None:
    """Start MPI (thread level MULTIPLE requested) and build the communicators; idempotent.

    ``comm`` restricts hvd_sgp to a sub-communicator, as Horovod's ``init(comm=...)`` does.
    """
    if place.current() is not None:
        return
    guarded = _join_guard()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    parent = MPI.Comm.Get_parent() if comm is None else MPI.COMM_NULL
    if spares.waiting():  # a warm spare: waits here until a repair calls it up
        world = world_grow.arrive(None, fault_mode.repair_seconds())
        signal.alarm(0)  # (spares.wait's join guard)
    elif parent != MPI.COMM_NULL:  # a replacement, spawned by the survivors' repair
        world = world_grow.arrive(parent, fault_mode.repair_seconds())
        if guarded:
            signal.alarm(0)
    else:
        comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        discovered = _discovered_at_launch()
        local, node = place.node_split(comm)
        parts = place.layout_of(comm, local)
        host_name = (MPI.Get_processor_name() if discovered is None else
                     discovery.assign(discovered, comm.Get_size())[comm.Get_rank()])
        entries = comm.allgather(entry(comm.Get_rank(), node, host_name))
        world = World(comm, local, parts.cross, MPI.Query_thread(), node, comm.Get_rank(),
                      entries, host_name)
        if discovered is not None:
            world.discovered = discovered
            world.allocated = {name for name, _ in discovered}
    place.install(world)
    fault_mode.configure(_world_revoked, _world_lost_peer, _revoke_all, world.origin, _peers,
                         _world_comm, _release)
    watchdog.start(world.world, world.origins, float(options.from_environment("timeout")),
                   world.thread_level >= MPI.THREAD_MULTIPLE)
    _abort_on_uncaught_errors()
    if not world.replacement:  # (a newcomer's pool was replenished as it joined)
        spares.replenish(world.world, world_grow.spares_wanted(), world.processes)


def _join_guard() -> bool:
    """On a process spawned by a grow (Open MPI sets OMPI_PARENT_PORT before MPI starts), in
    fault-tolerant mode: an alarm that ends it (SIGALRM, default action) when MPI_Init and the
    join (world_grow.arrive) have not completed within the repair's deadline. MPI_Init never
    returns when a survivor dies during the spawn, and holds the GIL: a Python timer could not
    act."""
    if ("OMPI_PARENT_PORT" not in os.environ or not options.from_environment("fault_tolerant")
            or spares.waiting()):
        return False
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(int(fault_mode.repair_seconds()))
    return True


def _discovered_at_launch() -> Optional[list]:
    """The hosts sgprun's discovery script found (HVD_SGP_DISCOVERED_HOSTS), or None without
    host discovery. A rank's host is then the one ``mpirun -H ... --map-by slot`` put it on
    (discovery.assign), as the script names it."""
    text = os.environ.get(discovery.VARIABLE, "").strip()
    if not text:
        if options.from_environment("host_discovery_script"):
            raise OptionError("HVD_SGP_HOST_DISCOVERY_SCRIPT is set, but the hosts were not "
                              "discovered at launch: start the job with 'sgprun "
                              "--host-discovery-script SCRIPT ...'")
        return None
    try:
        return discovery.decode(text)
    except discovery.DiscoveryError as error:
        raise OptionError(str(error)) from None


def shutdown() -> None:
    """Release the communicators; a later init() starts afresh. MPI itself ends at exit."""
    world = place.current()
    if world is None:
        return
    finalizers.run()
    spares.dismiss()
    place.install(None)
    watchdog.stop()
    world.close()


atexit.register(shutdown)


def _release() -> None:
    """Before a fault-tolerant rank's MPI_Finalize: every hvd_sgp communicator freed, the
    optimizers' private ones too (fault_mode._finalize says why)."""
    shutdown()
    free_tracked()


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
            watchdog.announce(f"raised {kind.__name__}: {value}")  # every rank says why
            MPI.COMM_WORLD.Abort(1)

    hook.hvd_sgp_abort = True
    sys.excepthook = hook


# --- the world's changes: repair (world_repair), grow and resize (world_grow) ---------------
def _revoke_all() -> None:
    world = place.current()
    if world is not None:
        world.revoke_all()


def _world_revoked() -> bool:
    world = place.current()
    return world is not None and world.revoked()


def _world_lost_peer() -> bool:
    world = place.current()
    return world is not None and world.lost_peer()


def _peers() -> list:
    world = place.current()
    return [] if world is None else world.peers() + spares.peers()


def _world_comm() -> Optional[MPI.Comm]:
    world = place.current()
    return None if world is None else world.world


def repair(realign: bool = True) -> WorldChange:
    """Repair the world in place after a lost rank (fault-tolerant mode); every survivor calls
    it, from wherever it noticed the failure. ``realign``: repaired inside a step (the
    optimizers realign their steps; no grow). See world_repair.repair."""
    return world_repair.repair(place.require(), realign)


def discovering() -> bool:
    """Whether the job runs with host discovery (sgprun --host-discovery-script)."""
    return place.require().discovered is not None


def hosts_changed(latest: Optional[list]) -> int:
    """Take the hosts the discovery script printed last (the same on every rank); returns
    discovery.ADDED / REMOVED when ranks will join / leave at ``resize``, 0 for no change.
    See world_grow.hosts_changed."""
    return world_grow.hosts_changed(place.require(), latest)


def resize_pending() -> bool:
    """A change of hosts was agreed at a commit and the world is not laid out for it yet."""
    return place.require().pending is not None


def replacements_due() -> bool:
    """Replacements for lost ranks wait to join at a commit (HVD_SGP_REPLACE_AT).
    See world_grow.replacements_due."""
    return world_grow.replacements_due(place.require())


def replacements_ready() -> bool:
    """At a commit: take the replacements in now? Collective. See
    world_grow.replacements_ready."""
    return world_grow.replacements_ready(place.require())


def replace() -> None:
    """Take in the replacements a repair deferred; every rank calls it. See
    world_grow.replace."""
    world_grow.replace(place.require())


def resize() -> bool:
    """Lay the world out for the agreed new hosts; every rank calls it. Returns True on a rank
    that must leave. See world_grow.resize."""
    return world_grow.resize(place.require())
