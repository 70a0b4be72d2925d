"""This process's place in the world: its rank, size, node and communicators, and the
layout of any group of ranks into nodes (``Layout``). runtime.init() installs the world here
and a repair or grow changes it in place; everything that communicates reads it here, below
the start-up and the changes (runtime.py, the world's public face, re-exports it).

A node is the set of ranks that share memory (an MPI shared-memory split); SGP gossips between
nodes and averages exactly inside one. ``HVD_SGP_LOCAL_SIZE=L`` groups consecutive ranks into
nodes of L ranks instead, so one machine can emulate several nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hvd_sgp.common import errors, options
from hvd_sgp.common.errors import NotInitializedError, OptionError, SgpValueError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.world import World

_world: Optional[World] = None  # None until init() and after shutdown()


def install(world: Optional[World]) -> None:
    """The world runtime.init() built (None: runtime.shutdown())."""
    global _world
    _world = world


def current() -> Optional[World]:
    """The world, or None before init() and after shutdown()."""
    return _world


errors.name_ranks_by(lambda: _world.world.Get_rank() if _world is not None else None)


def node_split(world: MPI.Comm) -> tuple[MPI.Comm, Any]:
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


@dataclass(frozen=True)
class Layout:
    """A group of ranks as SGP sees it: all of them, this rank's node, and the ranks with this
    local rank on every node (the whole world, or a Horovod process set's ranks)."""

    world: MPI.Comm
    local: MPI.Comm
    cross: MPI.Comm


def split(world: MPI.Comm) -> Layout:
    """Nodes and cross-node groups of ``world`` (collective over it; ``world`` is kept)."""
    return layout_of(world, node_split(world)[0])


def layout_of(world: MPI.Comm, local: MPI.Comm) -> Layout:
    """The layout of ``world`` with ``local`` as its nodes (collective over ``world``)."""
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
    world = require()
    return Layout(world.world, world.local, world.cross)


def is_initialized() -> bool:
    return _world is not None


def require() -> World:
    """The world; NotInitializedError before init()."""
    if _world is None:
        raise NotInitializedError()
    return _world


def world_comm() -> MPI.Comm:
    return require().world


def local_comm() -> MPI.Comm:
    return require().local


def cross_comm() -> MPI.Comm:
    return require().cross


def rank() -> int:
    return require().world.Get_rank()


def origin_rank() -> int:
    """This rank's rank at init(): how logs and errors name it across repairs."""
    return require().origin


def size() -> int:
    return require().world.Get_size()


def host() -> str:
    """This rank's host as the launcher names it: the discovery script's name with host
    discovery, MPI's processor name otherwise."""
    return require().host


def replacement() -> bool:
    """Whether this process was spawned to replace a lost rank (HVD_SGP_MAX_NP): it joined
    survivors that are inside hvd.elastic.run, at their ``state.sync()``."""
    return require().replacement


def local_rank() -> int:
    return require().local.Get_rank()


def local_size() -> int:
    return require().local.Get_size()


def cross_rank() -> int:
    return require().cross.Get_rank()


def cross_size() -> int:
    return require().cross.Get_size()


def mpi_threads_supported() -> bool:
    """True when MPI granted THREAD_MULTIPLE (needed for overlapped gossip)."""
    return require().thread_level >= MPI.THREAD_MULTIPLE
