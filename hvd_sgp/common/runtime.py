"""MPI start-up and the rank layout: world, node-local and cross-node communicators.

A node is the set of ranks that share memory (an MPI shared-memory split); SGP gossips between
nodes and averages exactly inside one. ``HVD_SGP_LOCAL_SIZE=L`` groups consecutive ranks into
nodes of L ranks instead, so one machine can emulate several nodes.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
from dataclasses import dataclass
from typing import Optional

from hvd_sgp.common import options
from hvd_sgp.common.errors import NotInitializedError, OptionError, SgpValueError
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
    def __init__(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm, thread_level: int):
        self.world = world
        self.local = local
        self.cross = cross
        self.thread_level = thread_level


_state: Optional[_State] = None


def _local_split(world: MPI.Comm) -> MPI.Comm:
    local_size = options.from_environment("local_size")
    if local_size is None:
        return world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    if world.Get_size() % local_size:
        raise OptionError(f"HVD_SGP_LOCAL_SIZE={local_size} must divide the number of ranks "
                            f"({world.Get_size()})")
    return world.Split(world.Get_rank() // local_size, key=world.Get_rank())


def init(comm: Optional[MPI.Comm] = None) -> None:
    """Start MPI (thread level MULTIPLE requested) and build the communicators; idempotent.

    ``comm`` restricts hvd_sgp to a sub-communicator, as Horovod's ``init(comm=...)`` does.
    """
    global _state
    if _state is not None:
        return
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    world = split((MPI.COMM_WORLD if comm is None else comm).Dup())
    _state = _State(world.world, world.local, world.cross, MPI.Query_thread())
    _abort_on_uncaught_errors()


@dataclass(frozen=True)
class Layout:
    """A group of ranks as SGP sees it: all of them, this rank's node, and the ranks with this
    local rank on every node (the whole world, or a Horovod process set's ranks)."""

    world: MPI.Comm
    local: MPI.Comm
    cross: MPI.Comm

    def free(self) -> None:
        for comm in (self.cross, self.local, self.world):
            if not MPI.Is_finalized():
                comm.Free()


def split(world: MPI.Comm) -> Layout:
    """Nodes and cross-node groups of ``world`` (collective over it; ``world`` is kept)."""
    local = _local_split(world)
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
    for comm in (_state.cross, _state.local, _state.world):
        if not MPI.Is_finalized():
            comm.Free()
    _state = None


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
    peers blocked forever and the rank itself stuck in MPI_Finalize at exit."""
    previous = sys.excepthook
    if getattr(previous, "hvd_sgp_abort", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        if not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)

    hook.hvd_sgp_abort = True
    sys.excepthook = hook
