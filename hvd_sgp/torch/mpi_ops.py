"""horovod.torch's basics and collectives on torch tensors, through the negotiated numpy core
(hvd_sgp.common.horovod_api).

Tensors travel through host memory for these exact collectives (metrics, broadcasts, state);
16-bit floats are reduced in float32. The synchronous collectives are differentiable, with
Horovod's gradients: allreduce -> allreduce of the gradient with the same op and scaling;
allgather -> Average-allreduce of the gradient, this rank's rows; broadcast -> Average-
allreduce on the root, zero elsewhere; alltoall -> alltoall back with the received splits;
reducescatter -> allgather of the gradient, times the set size for Sum and the scale factors.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from hvd_sgp.common.errors import (HorovodInternalError, HostsUpdatedInterrupt,  # noqa: F401
                                   SgpValueError)
from hvd_sgp.common import runtime  # noqa: F401  (exported: hvd.runtime)
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.common.horovod_api.basics import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.common.horovod_api.basics import (Average, ProcessSet, ReduceOp, Sum,
                                               global_process_set, resolve_op)
from hvd_sgp.common.horovod_api.basics import __all__ as _basics
from hvd_sgp.common.horovod_api.negotiation import Handle
from hvd_sgp.torch.compression import Compression


def nccl_built() -> int:
    """The NCCL version torch was built with (Horovod's encoding, e.g. 21803), 0 without."""
    if not (torch.cuda.is_available() and torch.distributed.is_available()
            and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


# --- tensors <-> arrays ---------------------------------------------------------------------
def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise SgpValueError(f"{what} takes torch tensors, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise SgpValueError(f"{what} takes dense tensors; use sparse_allreduce_async for sparse")


def to_numpy(tensor: torch.Tensor, reduce: bool = True) -> np.ndarray:
    """A host array of the tensor's values. bfloat16 (no numpy type) travels widened to
    float32 where it is reduced, else as its raw 16-bit words."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float() if reduce else t.view(torch.int16)
    return t.cpu().contiguous().numpy()


def from_numpy(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``array`` as a tensor of ``like``'s dtype and device."""
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = np.ascontiguousarray(array)
    t = torch.from_numpy(array)
    if like.dtype == torch.bfloat16 and t.dtype == torch.int16:
        t = t.view(torch.bfloat16)
    return t.to(device=like.device, dtype=like.dtype)


def _arrays(tensors: Sequence[torch.Tensor], what: str, reduce: bool) -> dict:
    """The core's arguments for ``tensors``: arrays, framework dtypes, devices."""
    for t in tensors:
        _check_tensor(t, what)
    return dict(dtypes=[str(t.dtype) for t in tensors],
                devices=[t.device.type for t in tensors],
                arrays=[to_numpy(t, reduce) for t in tensors])


# --- Horovod's handle table -----------------------------------------------------------------
_handles: dict[int, tuple[Handle, Callable[[Any], Any]]] = {}
_handle_lock = threading.Lock()
_next_handle = [0]


def _register(handle: Handle, finish: Callable[[Any], Any]) -> int:
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
    """Wait for an async collective and return its result (or raise its error)."""
    with _handle_lock:
        if handle not in _handles:
            raise SgpValueError(f"unknown or already synchronized handle {handle}")
        work, finish = _handles.pop(handle)
    return finish(work.wait())


# --- asynchronous collectives ---------------------------------------------------------------
def _outputs(tensors: Sequence[torch.Tensor], inplace: bool) -> Callable[[list], list]:
    """How results come back: copied into the inputs (in place) or as new tensors."""
    if inplace:  # (a result that is the tensor's own memory already holds it)
        return lambda results: [t if _holds(t, r) else t.copy_(from_numpy(r, t))
                                for t, r in zip(tensors, results)]
    return lambda results: [from_numpy(r, t) for t, r in zip(tensors, results)]


def _holds(tensor: torch.Tensor, array: np.ndarray) -> bool:
    """``array`` is ``tensor``'s own memory (to_numpy shares a contiguous CPU tensor's)."""
    return (tensor.device.type == "cpu" and tensor.is_contiguous()
            and array.ctypes.data == tensor.data_ptr() and array.nbytes == tensor.nbytes)


def _grouped_allreduce_handle(tensors, average, name, op, prescale_factor, postscale_factor,
                              process_set, inplace: bool) -> int:
    tensors = list(tensors)
    work = collectives.grouped_allreduce_async(
        op=resolve_op(average, op), prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name, process_set=process_set,
        **_arrays(tensors, "allreduce", True))
    return _register(work, _outputs(tensors, inplace))


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[ReduceOp] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an exact reduction (a new tensor at synchronize); returns a handle."""
    return _single(_grouped_allreduce_handle([tensor], average, name, op, prescale_factor,
                                             postscale_factor, process_set, False))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[ReduceOp] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place reduction of ``tensor``; returns a handle."""
    return _single(_grouped_allreduce_handle([tensor], average, name, op, prescale_factor,
                                             postscale_factor, process_set, True))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one negotiated reduction of several tensors (new tensors at synchronize)."""
    return _grouped_allreduce_handle(tensors, average, name, op, prescale_factor,
                                     postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start one negotiated in-place reduction of several tensors."""
    return _grouped_allreduce_handle(tensors, average, name, op, prescale_factor,
                                     postscale_factor, process_set, True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[ReduceOp] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def _single(handle: int) -> int:
    """A grouped handle whose result is its only tensor."""
    work, finish = _handles[handle]
    _handles[handle] = (work, lambda results: finish(results)[0])
    return handle


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    tensors = list(tensors)
    work = collectives.grouped_allgather_async(name=name, process_set=process_set,
                                               **_arrays(tensors, "allgather", False))
    return _register(work, _outputs(tensors, False))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's tensor along dimension 0 (sizes may differ there)."""
    return _single(grouped_allgather_async([tensor], name, process_set))


def _broadcast_handle(tensors, root_rank, name, process_set, inplace: bool) -> int:
    tensors = list(tensors)
    work = collectives.grouped_broadcast_async(root_rank=root_rank, name=name,
                                               process_set=process_set, into=inplace,
                                               **_arrays(tensors, "broadcast", False))
    return _register(work, _outputs(tensors, inplace))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast from the global rank ``root_rank`` (a new tensor at synchronize)."""
    return _single(_broadcast_handle([tensor], root_rank, name, process_set, False))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast from the global rank ``root_rank``."""
    return _single(_broadcast_handle([tensor], root_rank, name, process_set, True))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start scattering rows of dimension 0 to the set's ranks by ``splits`` (a 1-d integer
    tensor); synchronize gives (rows received, counts received from each rank)."""
    _check_tensor(tensor, "alltoall")
    if isinstance(splits, torch.Tensor):
        split_values = splits.detach().cpu().numpy()
    else:
        split_values = None if splits is None else np.asarray(splits)
    work = collectives.alltoall_async(to_numpy(tensor, False), split_values, name, process_set,
                                      str(tensor.dtype), tensor.device.type)
    device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

    def finish(result):
        out, received = result
        return from_numpy(out, tensor), torch.from_numpy(received.astype(np.int32)).to(device)
    return _register(work, finish)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    tensors = list(tensors)
    work = collectives.grouped_reducescatter_async(
        op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name,
        process_set=process_set, **_arrays(tensors, "reducescatter", True))
    return _register(work, _outputs(tensors, False))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reduction whose rows of dimension 0 are scattered over the set's ranks (the
    first ``rows % size`` ranks get one more)."""
    return _single(grouped_reducescatter_async([tensor], name, op, process_set,
                                               prescale_factor, postscale_factor))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by allgathering its indices and values (duplicates sum when
    the result is coalesced); returns a callable that waits and gives the sparse result."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise SgpValueError("sparse_allreduce_async takes a sparse COO tensor")
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        raise SgpValueError(f"sparse_allreduce_async supports Average or Sum, got {op.name}")
    indices = allgather_async(tensor._indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(tensor._values(), f"{name}.values", process_set)

    def wait() -> torch.Tensor:
        gathered = synchronize(values)
        if op == Average:
            gathered = gathered / process_set.size()
        return torch.sparse_coo_tensor(synchronize(indices).t(), gathered, tensor.shape)
    return wait


# --- the synchronous, differentiable collectives ---------------------------------------------
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, name, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(_grouped_allreduce_handle(
            tensors, None, name, op, prescale, postscale, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None,) * 5 + tuple(grouped_allreduce(
            list(grads), op=op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.process_set = process_set
        ctx.shapes = [t.shape for t in tensors]
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        mine = [s[0] if len(s) else 1 for s in ctx.shapes]
        rows = synchronize(allgather_async(torch.tensor([mine]), process_set=ctx.process_set))
        offsets = rows[:ctx.process_set.rank()].sum(dim=0).tolist()
        return (None, None) + tuple(g.narrow(0, o, n).reshape(s) for g, o, n, s in
                                    zip(reduced, offsets, mine, ctx.shapes))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, root_rank, name, process_set, tensor):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return None, None, None, reduced if rank() == ctx.root_rank else reduced * 0


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, splits, name, process_set, tensor):
        ctx.process_set = process_set
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = alltoall(grad, ctx.received, process_set=ctx.process_set)
        return None, None, None, back


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, name, process_set, *tensors):
        ctx.scale = (process_set.size() if op == Sum else 1) * prescale * postscale
        ctx.process_set = process_set
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        scaled = [g * ctx.scale if ctx.scale != 1 else g for g in grads]
        return (None,) * 5 + tuple(grouped_allgather(scaled, process_set=ctx.process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression=Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    """Exact reduction of several tensors in one negotiation (new tensors; differentiable)."""
    compressed = [compression.compress(t) for t in tensors]
    reduced = _Allreduce.apply(resolve_op(average, op), prescale_factor, postscale_factor, name,
                               process_set, *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Exact reduction across the set's ranks (a new tensor; differentiable); for metrics and
    state, not gradients."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)[0]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    return list(_Allgather.apply(name, process_set, *tensors))


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ there)."""
    return grouped_allgather([tensor], name, process_set)[0]


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's tensor on every rank (a new tensor; differentiable). ``root_rank`` is global."""
    return _Broadcast.apply(root_rank, name, process_set, tensor)


def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """Scatter rows of dimension 0 to the set's ranks by ``splits``; with splits, also return
    the counts received from each rank (as horovod.torch does)."""
    out, received = _Alltoall.apply(splits, name, process_set, tensor)
    return out if splits is None else (out, received)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression=Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    compressed = [compression.compress(t) for t in tensors]
    out = _Reducescatter.apply(op, prescale_factor, postscale_factor, name, process_set,
                               *[c for c, _ in compressed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, compressed)]


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression=Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across the set; rank r keeps its rows of dimension 0 (differentiable)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


__all__ = list(_basics) + [
    "nccl_built", "cuda_built", "rocm_built", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "poll",
    "synchronize", "runtime", "HorovodInternalError", "HostsUpdatedInterrupt",
]
