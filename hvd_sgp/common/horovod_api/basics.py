"""Horovod's framework-independent basics, shared by the torch and tensorflow packages:
init/shutdown (with process sets), the rank queries, reduction ops, build flags, process-set
management, barrier, join and the run-time timeline."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from hvd_sgp.common import runtime, telemetry
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.horovod_api import collectives, negotiation
from hvd_sgp.common.horovod_api import process_sets as sets
from hvd_sgp.common.horovod_api.collectives import ReduceOp, barrier, submit
from hvd_sgp.common.horovod_api.join import join
from hvd_sgp.common.horovod_api.negotiation import Handle
from hvd_sgp.common.horovod_api.process_sets import ProcessSet, global_process_set
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.runtime import (cross_rank, cross_size, is_initialized, local_rank,
                                    local_size, mpi_threads_supported, rank, size)

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


def init(comm: Optional[MPI.Comm] = None,
         process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Start MPI and the collective layer (HVD_SGP_TIMEOUT and Horovod's stall settings are
    read here); register ``process_sets`` as Horovod's ``init(process_sets=...)``. Every rank
    calls it; calling it again is harmless."""
    runtime.init(comm)
    sets.start(negotiation.Settings.from_environ())
    if process_sets:
        _register(list(process_sets))


def _register(given: list) -> None:
    """Every rank's sets become every rank's (a communicator-made set differs by rank), in
    the order of first appearance by rank, then each object gets its id."""
    for ps in given:
        if not isinstance(ps, ProcessSet):
            raise SgpValueError(f"process_sets takes ProcessSet objects, got {type(ps).__name__}")
        if ps.ranks is None:
            ps.ranks = sets.world_ranks_of(ps.mpi_comm)
    everyone = collectives.allgather_object([tuple(ps.ranks) for ps in given])
    for ranks in dict.fromkeys(r for lists in everyone for r in lists):
        if sets.find(ranks) is None:
            add_process_set(list(ranks))
    for ps in given:
        sets.adopt(ps, sets.find(ps.ranks))


def shutdown() -> None:
    """Release the collective layer and MPI's communicators; a later init() starts afresh."""
    sets.stop()
    runtime.shutdown()


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a set after init (collective over every rank, all passing the same ranks)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI "
                                  "communicator is not implemented. Please build the process "
                                  "set via a list of ranks.")
    problem = sets.problem_with(ps.ranks)
    op = submit("add_process_set", None, global_process_set, None, problem=problem,
                extra=tuple(ps.ranks))
    sets.adopt(ps, Handle(op).wait())
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (collective over every rank); False for the global set or a set that
    is not registered."""
    sid = getattr(process_set, "process_set_id", None)
    if not sid or process_set.ranks is None or sets.find(process_set.ranks) != sid:
        return False
    Handle(submit("remove_process_set", None, global_process_set, None, extra=(sid,))).wait()
    return True


def process_set_comm(process_set: ProcessSet = global_process_set) -> Optional[MPI.Comm]:
    """The communicator of a process set's ranks (None on ranks outside it)."""
    return sets.process_set_comm(process_set)


def resolve_op(average: Optional[bool], op: Optional[ReduceOp]) -> ReduceOp:
    """Horovod's deprecated ``average=`` or ``op=`` (default Average); Adasum is refused."""
    if average is not None and op is not None:
        raise SgpValueError("pass either average= (deprecated) or op=, not both")
    chosen = (Average if average or average is None else Sum) if op is None else op
    return collectives.check_op(chosen)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the collectives (negotiation and data phases) as a Chrome trace into
    ``file_path`` from now on; every rank calls it, rank 0 writes the merged file."""
    stop_timeline()
    negotiation.set_timeline(negotiation.TimelineRecorder(
        telemetry.Timeline(file_path, rank(), size()), mark_cycles))


def stop_timeline() -> None:
    """Stop recording and write the timeline file (rank 0 merges the ranks' parts)."""
    recorder = negotiation.active_timeline()
    negotiation.set_timeline(None)
    if recorder is not None:
        recorder.timeline.finish()


def is_homogeneous() -> bool:
    """Every node has the same number of ranks (hvd_sgp requires it)."""
    return True


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "ddl_built", "ccl_built", "is_homogeneous", "Average", "Sum",
    "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "process_set_comm", "resolve_op", "barrier",
    "join", "start_timeline", "stop_timeline",
]
