"""MPI start-up and the rank layout: world, node-local and cross-node communicators, held in
one ``World`` (world.py); the public face of the world's changes.

A node is the set of ranks that share memory (an MPI shared-memory split); SGP gossips between
nodes and averages exactly inside one. ``HVD_SGP_LOCAL_SIZE=L`` groups consecutive ranks into
nodes of L ranks instead, so one machine can emulate several nodes.

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
from typing import Any, Optional

from hvd_sgp.common import (discovery, errors, fault_mode, options, recovery, watchdog,
                            world_grow, world_repair)
from hvd_sgp.common.errors import NotInitializedError, OptionError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.world import World, WorldChange
# The world's change API, defined in world.py, is reached as runtime.* (engine, transport,
# the Horovod-API layer), as the rest of the world's public face.
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


_world: Optional[World] = None  # None until init() and after shutdown()


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
    global _world
    if _world is not None:
        return
    guarded = _join_guard()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    parent = MPI.Comm.Get_parent() if comm is None else MPI.COMM_NULL
    if parent != MPI.COMM_NULL:  # a replacement, spawned by the survivors' repair
        _world = world_grow.arrive(parent)
        if guarded:
            signal.alarm(0)
    else:
        comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        discovered = _discovered_at_launch()
        local, node = _local_split(comm)
        parts = _layout(comm, local)
        host = (MPI.Get_processor_name() if discovered is None else
                discovery.assign(discovered, comm.Get_size())[comm.Get_rank()])
        entries = [(r, n, h) for r, (n, h) in enumerate(comm.allgather((node, host)))]
        _world = World(comm, local, parts.cross, MPI.Query_thread(), node, comm.Get_rank(),
                       entries, host)
        if discovered is not None:
            _world.discovered = discovered
            _world.allocated = {name for name, _ in discovered}
    fault_mode.configure(_world_revoked, _revoke_all, _world.origin)
    watchdog.start(_world.world, _world.origins, float(options.from_environment("timeout")),
                   _world.thread_level >= MPI.THREAD_MULTIPLE)
    _abort_on_uncaught_errors()


def _join_guard() -> bool:
    """On a process spawned by a grow (Open MPI sets OMPI_PARENT_PORT before MPI starts), in
    fault-tolerant mode: an alarm that ends it (SIGALRM, default action) when MPI_Init and the
    join (world_grow.arrive) have not completed within the repair's deadline. MPI_Init never
    returns when a survivor dies during the spawn, and holds the GIL: a Python timer could not
    act."""
    if "OMPI_PARENT_PORT" not in os.environ or not options.from_environment("fault_tolerant"):
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
    world = _require()
    return Layout(world.world, world.local, world.cross)


def shutdown() -> None:
    """Release the communicators; a later init() starts afresh. MPI itself ends at exit."""
    global _world
    if _world is None:
        return
    world, _world = _world, None
    watchdog.stop()
    world.close()


atexit.register(shutdown)
errors.name_ranks_by(lambda: _world.world.Get_rank() if _world is not None else None)


def is_initialized() -> bool:
    return _world is not None


def _require() -> World:
    if _world is None:
        raise NotInitializedError()
    return _world


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


def host() -> str:
    """This rank's host as the launcher names it: the discovery script's name with host
    discovery, MPI's processor name otherwise."""
    return _require().host


def replacement() -> bool:
    """Whether this process was spawned to replace a lost rank (HVD_SGP_MAX_NP): it joined
    survivors that are inside hvd.elastic.run, at their ``state.sync()``."""
    return _require().replacement


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
            watchdog.announce(f"raised {kind.__name__}: {value}")  # every rank says why
            MPI.COMM_WORLD.Abort(1)

    hook.hvd_sgp_abort = True
    sys.excepthook = hook


# --- the world's changes: repair (world_repair), grow and resize (world_grow) ---------------
def _revoke_all() -> None:
    world = _world
    if world is not None:
        world.revoke_all()


def _world_revoked() -> bool:
    world = _world
    return world is not None and world.revoked()


def repair(realign: bool = True) -> WorldChange:
    """Repair the world in place after a lost rank (fault-tolerant mode); every survivor calls
    it, from wherever it noticed the failure. ``realign``: repaired inside a step (the
    optimizers realign their steps; no grow). See world_repair.repair."""
    return world_repair.repair(_require(), realign)


def discovering() -> bool:
    """Whether the job runs with host discovery (sgprun --host-discovery-script)."""
    return _require().discovered is not None


def hosts_changed(latest: Optional[list]) -> int:
    """Take the hosts the discovery script printed last (the same on every rank); returns
    discovery.ADDED / REMOVED when ranks will join / leave at ``resize``, 0 for no change.
    See world_grow.hosts_changed."""
    return world_grow.hosts_changed(_require(), latest)


def resize_pending() -> bool:
    """A change of hosts was agreed at a commit and the world is not laid out for it yet."""
    return _require().pending is not None


def resize() -> bool:
    """Lay the world out for the agreed new hosts; every rank calls it. Returns True on a rank
    that must leave. See world_grow.resize."""
    return world_grow.resize(_require())
