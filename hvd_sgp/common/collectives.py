"""Exact collectives on numpy arrays for metrics, broadcasts and the AllReduce baseline.

Adapters convert framework tensors to numpy and back; all MPI calls for them happen here.
Non-blocking variants return a Handle that the adapters keep in Horovod's handle table.
"""
from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Optional

import numpy as np

from hvd_sgp.common import recovery, runtime
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.mpi import MPI


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (same integer values as horovod.common.basics)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


_MPI_OPS = {ReduceOp.Average: MPI.SUM, ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN,
            ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}


def mpi_op(op: ReduceOp) -> MPI.Op:
    if op == ReduceOp.Adasum:
        raise SgpValueError("op=Adasum is not offered by hvd_sgp: SGP already replaces the "
                            "gradient allreduce; use op=Average (the default)")
    try:
        return _MPI_OPS[ReduceOp(op)]
    except (KeyError, ValueError):
        raise SgpValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max or Product")


def _translated(fn: Callable) -> Callable:
    """A lost peer (fault-tolerant mode) surfaces as PeerLostError, a HorovodInternalError
    that hvd.elastic.run repairs."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with recovery.translated(f"hvd.{fn.__name__}"):
            return fn(*args, **kwargs)
    return wrapper


class Handle:
    """A collective in flight; ``wait()`` returns its result, ``done()`` polls it."""

    def __init__(self, request: Optional[MPI.Request], finish: Callable[[], Any],
                 buffers: tuple = ()):
        self._request = request
        self._finish = finish
        self._buffers = buffers  # MPI reads and writes them until the request completes
        self._result: Any = None
        self._complete = False

    def done(self) -> bool:
        return self._complete or self._request is None or bool(self._request.Test())

    @_translated
    def wait(self) -> Any:
        if not self._complete:
            if self._request is not None:
                self._request.Wait()
            self._result = self._finish()
            self._complete = True
            self._buffers = ()
        return self._result


def _comm(comm: Optional[MPI.Comm]) -> MPI.Comm:
    return comm if comm is not None else runtime.world_comm()


@_translated
def allreduce_async(array: np.ndarray, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    comm: Optional[MPI.Comm] = None, out: Optional[np.ndarray] = None) -> Handle:
    """Start an allreduce of ``array``; the result lands in ``out`` (a new array by default)."""
    comm = _comm(comm)
    reduction = mpi_op(op)
    source = np.ascontiguousarray(array)
    if prescale_factor != 1.0:
        source = source * np.asarray(prescale_factor, dtype=source.dtype)
    result = np.empty_like(source) if out is None else out
    if source is result:
        request = comm.Iallreduce(MPI.IN_PLACE, result, op=reduction)
    else:
        request = comm.Iallreduce(source, result, op=reduction)

    def finish() -> np.ndarray:
        scale = postscale_factor / (comm.Get_size() if op == ReduceOp.Average else 1)
        if scale != 1.0:
            if result.dtype.kind in "iub":
                np.floor_divide(result, comm.Get_size(), out=result, casting="unsafe")
            else:
                np.multiply(result, np.asarray(scale, dtype=result.dtype), out=result)
        return result

    return Handle(request, finish, (source, result))


@_translated
def allreduce(array: np.ndarray, op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, comm: Optional[MPI.Comm] = None,
              out: Optional[np.ndarray] = None) -> np.ndarray:
    return allreduce_async(array, op, prescale_factor, postscale_factor, comm, out).wait()


@_translated
def allgather_async(array: np.ndarray, comm: Optional[MPI.Comm] = None) -> Handle:
    """Concatenate every rank's array along the first dimension (first dims may differ)."""
    comm = _comm(comm)
    source = np.ascontiguousarray(array)
    if source.ndim == 0:
        source = source.reshape(1)
    rows = comm.allgather(source.shape)
    tails = {shape[1:] for shape in rows}
    if len(tails) != 1:
        raise SgpValueError(f"allgather needs the same trailing shape on every rank, got {rows}")
    row = int(np.prod(source.shape[1:], dtype=np.int64))
    counts = [shape[0] * row for shape in rows]
    result = np.empty((sum(shape[0] for shape in rows), *source.shape[1:]), dtype=source.dtype)
    request = comm.Iallgatherv(source, [result, counts])
    return Handle(request, lambda: result, (source, result))


@_translated
def allgather(array: np.ndarray, comm: Optional[MPI.Comm] = None) -> np.ndarray:
    return allgather_async(array, comm).wait()


@_translated
def broadcast_async(array: np.ndarray, root_rank: int, comm: Optional[MPI.Comm] = None,
                    inplace: bool = False) -> Handle:
    """Broadcast from ``root_rank``; in place when asked (the array must be contiguous)."""
    comm = _comm(comm)
    _check_root(root_rank, comm)
    target = array if inplace else np.array(array, copy=True, order="C")
    if not target.flags.c_contiguous:
        raise SgpValueError("in-place broadcast needs a contiguous array")
    return Handle(comm.Ibcast(target, root=root_rank), lambda: target, (target,))


@_translated
def broadcast(array: np.ndarray, root_rank: int, comm: Optional[MPI.Comm] = None,
              inplace: bool = False) -> np.ndarray:
    return broadcast_async(array, root_rank, comm, inplace).wait()


@_translated
def alltoall(array: np.ndarray, splits: Optional[np.ndarray] = None,
             comm: Optional[MPI.Comm] = None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` of the first dimension to rank j; returns (rows received, counts)."""
    comm = _comm(comm)
    source = np.ascontiguousarray(array)
    n = comm.Get_size()
    if splits is None:
        if source.shape[0] % n:
            raise SgpValueError(f"alltoall without splits needs the first dimension "
                                f"({source.shape[0]}) divisible by the number of ranks ({n})")
        splits = np.full(n, source.shape[0] // n, dtype=np.int64)
    splits = np.asarray(splits, dtype=np.int64)
    if splits.shape != (n,) or splits.sum() != source.shape[0] or (splits < 0).any():
        raise SgpValueError(f"alltoall splits {splits.tolist()} must be {n} non-negative "
                            f"counts summing to {source.shape[0]}")
    received = np.empty(n, dtype=np.int64)
    comm.Alltoall(splits, received)
    row = int(np.prod(source.shape[1:], dtype=np.int64))
    result = np.empty((int(received.sum()), *source.shape[1:]), dtype=source.dtype)
    send_counts, recv_counts = splits * row, received * row
    comm.Alltoallv([source, (send_counts.tolist(), _displacements(send_counts))],
                   [result, (recv_counts.tolist(), _displacements(recv_counts))])
    return result, received


@_translated
def reducescatter(array: np.ndarray, op: ReduceOp = ReduceOp.Average,
                  comm: Optional[MPI.Comm] = None) -> np.ndarray:
    """Reduce across ranks and give rank r its slice of the first dimension (earlier ranks
    take the remainder, as Horovod does)."""
    comm = _comm(comm)
    n = comm.Get_size()
    reduced = allreduce(array, op, comm=comm)
    base, extra = divmod(reduced.shape[0], n)
    r = comm.Get_rank()
    start = r * base + min(r, extra)
    return reduced[start:start + base + (1 if r < extra else 0)].copy()


@_translated
def broadcast_object(obj: Any, root_rank: int = 0, comm: Optional[MPI.Comm] = None) -> Any:
    comm = _comm(comm)
    _check_root(root_rank, comm)
    return comm.bcast(obj, root=root_rank)


@_translated
def allgather_object(obj: Any, comm: Optional[MPI.Comm] = None) -> list:
    return _comm(comm).allgather(obj)


@_translated
def barrier(comm: Optional[MPI.Comm] = None) -> None:
    _comm(comm).Barrier()


def _displacements(counts: np.ndarray) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()


def _check_root(root_rank: int, comm: MPI.Comm) -> None:
    if not 0 <= root_rank < comm.Get_size():
        raise SgpValueError(f"root_rank {root_rank} is out of range for {comm.Get_size()} ranks")
