"""Horovod's framework-independent basics, shared by the torch and tensorflow packages:
the runtime queries, reduction ops, process sets, build flags, ``join``."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from hvd_sgp.common import collectives
from hvd_sgp.common.collectives import ReduceOp
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                                    local_size, mpi_threads_supported, rank, shutdown, size)

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


class ProcessSet:
    """Only the global process set is offered: SGP's graph spans every rank."""

    def __init__(self, ranks=None):
        self.ranks = ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def check_process_set(process_set: ProcessSet) -> None:
    if process_set is not global_process_set:
        raise SgpValueError("hvd_sgp offers only the global process set")


def resolve_op(average: Optional[bool], op: Optional[ReduceOp]) -> ReduceOp:
    """Horovod's deprecated ``average=`` or ``op=`` (default Average); Adasum is refused."""
    if average is not None and op is not None:
        raise SgpValueError("pass either average= (deprecated) or op=, not both")
    chosen = (Average if average or average is None else Sum) if op is None else ReduceOp(op)
    collectives.mpi_op(chosen)  # raises the clear Adasum / unknown-op error
    return chosen


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def barrier(process_set: ProcessSet = global_process_set) -> None:
    check_process_set(process_set)
    collectives.barrier()


def join(device: int = -1) -> int:
    """Wait for every rank; returns the rank that arrived last."""
    times = collectives.allgather_object(time.monotonic_ns())
    return int(np.argmax(times))


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "check_process_set", "resolve_op", "barrier", "join",
]
