"""horovod.torch's basics and collectives on torch tensors, through the numpy core.

CUDA tensors are staged through host memory for these exact collectives (metrics, broadcasts);
16-bit floats are reduced in float32.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np
import torch

from hvd_sgp.common import collectives, runtime
from hvd_sgp.common.basics import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.common.basics import (Average, ProcessSet, ReduceOp, check_process_set,
                                   global_process_set, resolve_op)
from hvd_sgp.common.basics import __all__ as _basics
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.torch.compression import Compression


def nccl_built() -> bool:
    return torch.cuda.is_available() and torch.distributed.is_available() and \
        torch.distributed.is_nccl_available()


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host array with the tensor's values (16-bit floats widened to float32)."""
    t = tensor.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.cpu().contiguous().numpy()


def from_numpy(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = np.ascontiguousarray(array)
    return torch.from_numpy(array).to(device=like.device, dtype=like.dtype)


# Horovod's handle table: integer handles for async collectives, finished by synchronize().
_handles: dict[int, tuple[collectives.Handle, Callable[[Any], Any]]] = {}
_handle_lock = threading.Lock()
_next_handle = [0]


def _register(handle: collectives.Handle, finish: Callable[[Any], Any]) -> int:
    with _handle_lock:
        _next_handle[0] += 1
        _handles[_next_handle[0]] = (handle, finish)
        return _next_handle[0]


def poll(handle: int) -> bool:
    """True when the async collective behind ``handle`` has finished."""
    if handle not in _handles:
        raise SgpValueError(f"unknown or already synchronized handle {handle}")
    return _handles[handle][0].done()


def synchronize(handle: int):
    """Wait for an async collective and return its result."""
    with _handle_lock:
        if handle not in _handles:
            raise SgpValueError(f"unknown or already synchronized handle {handle}")
        work, finish = _handles.pop(handle)
    return finish(work.wait())


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    work = collectives.allreduce_async(to_numpy(tensor), resolve_op(average, op), prescale_factor,
                                       postscale_factor)
    return _register(work, lambda result: from_numpy(result, tensor))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Exact reduction across ranks (a new tensor); for metrics and state, not gradients."""
    compressed, ctx = compression.compress(tensor)
    handle = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                             process_set)
    return compression.decompress(synchronize(handle), ctx)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[ReduceOp] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    work = collectives.allreduce_async(to_numpy(tensor), resolve_op(average, op), prescale_factor,
                                       postscale_factor)
    return _register(work, lambda result: tensor.copy_(from_numpy(result, tensor)))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce(tensors, average: Optional[bool] = None, name: Optional[str] = None,
                      compression=Compression.none, op: Optional[ReduceOp] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    handles = []
    for t in tensors:
        compressed, ctx = compression.compress(t)
        handles.append((allreduce_async(compressed, average, name, op, prescale_factor,
                                        postscale_factor, process_set), ctx))
    return [compression.decompress(synchronize(h), ctx) for h, ctx in handles]


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    work = collectives.allgather_async(to_numpy(tensor))
    return _register(work, lambda result: from_numpy(result, tensor))


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ there)."""
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    work = collectives.broadcast_async(to_numpy(tensor), root_rank)
    return _register(work, lambda result: from_numpy(result, tensor))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    work = collectives.broadcast_async(to_numpy(tensor), root_rank, inplace=True)
    return _register(work, lambda result: tensor.copy_(from_numpy(result, tensor)))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall(tensor: torch.Tensor, splits: Optional[torch.Tensor] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Scatter rows of dimension 0 to ranks by ``splits``; with splits, also return the counts
    received from each rank (as horovod.torch does)."""
    check_process_set(process_set)
    split_array = None if splits is None else np.asarray(
        splits.cpu().numpy() if isinstance(splits, torch.Tensor) else splits, dtype=np.int64)
    out, received = collectives.alltoall(to_numpy(tensor), split_array)
    result = from_numpy(out, tensor)
    return result if splits is None else (result, torch.from_numpy(received.astype(np.int32)))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression=Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = collectives.reducescatter(to_numpy(compressed), op)
    return compression.decompress(from_numpy(out, compressed), ctx)


__all__ = list(_basics) + [
    "nccl_built", "cuda_built", "rocm_built", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "reducescatter",
    "poll", "synchronize", "runtime",
]
