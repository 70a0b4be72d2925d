"""horovod.tensorflow's basics and collectives on TF tensors, through the negotiated numpy
core (hvd_sgp.common.horovod_api): the same negotiation, process sets and join as torch's.

Every collective works eagerly and inside ``tf.function`` (see bridge.py). These are for
metrics, broadcasts and state; training itself gossips through DistributedOptimizer or
DistributedGradientTape. Sparse tensors (IndexedSlices) are densified; 16-bit floats travel
as float32. Gradients are Horovod's: allreduce -> allreduce of the gradient (same op and
scaling); allgather -> Average-allreduce, this rank's rows; broadcast -> Average-allreduce on
the root, zero elsewhere; alltoall -> alltoall back; reducescatter -> allgather, times the
set size for Sum and the scale factors.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvd_sgp.common.errors import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.common.horovod_api.basics import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.common.horovod_api.basics import (Average, ProcessSet, ReduceOp, Sum,
                                               global_process_set, rank, resolve_op)
from hvd_sgp.common.horovod_api.basics import __all__ as _basics
from hvd_sgp.tensorflow import bridge
from hvd_sgp.tensorflow.compression import Compression

# Traced as they are: AutoGraph would otherwise try (and warn) to convert mpi4py's methods.
_not_autograph = tf.autograph.experimental.do_not_convert


def nccl_built() -> int:
    return 0


def cuda_built() -> bool:
    return tf.test.is_built_with_cuda()


def rocm_built() -> bool:
    return tf.test.is_built_with_rocm()


def _run(what: str, start: Callable[..., collectives.Handle], tensors: Sequence[tf.Tensor],
         shapes: Sequence) -> list[tf.Tensor]:
    """One negotiated collective on ``tensors`` (widened for MPI), as one bridge call:
    ``start(arrays, dtype names)`` submits it; its result is the list of output arrays."""
    names = [t.dtype.name for t in tensors]
    wide = [bridge.widened(t) for t in tensors]
    out = bridge.call(lambda *arrays: start(list(arrays), names).wait(), wide,
                      [w.dtype for w in wide], shapes, f"hvd_sgp {what}")
    return [tf.cast(o, t.dtype) for o, t in zip(out, tensors)]


def _reduce(tensors: Sequence[tf.Tensor], op: ReduceOp, prescale: float, postscale: float,
            process_set: ProcessSet) -> list[tf.Tensor]:
    """Grouped allreduce with Horovod's gradient (the same allreduce of the gradients)."""
    @tf.custom_gradient
    def reduce(*xs):
        def grad(*dys):
            return _reduce([tf.convert_to_tensor(d) for d in dys], op, prescale, postscale,
                           process_set)
        return _run("allreduce", lambda arrays, names: collectives.grouped_allreduce_async(
            arrays, op, prescale, postscale, None, process_set, names), xs,
            [x.shape for x in xs]), grad
    return list(reduce(*tensors))


@_not_autograph
def grouped_allreduce(tensors: Sequence, average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Exact reductions of several tensors in one negotiation (one op in a graph)."""
    reduction = resolve_op(average, op)
    compressed = [compression.compress(bridge.dense(t)) for t in tensors]
    out = _reduce([tf.convert_to_tensor(c) for c, _ in compressed], reduction, prescale_factor,
                  postscale_factor, process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, compressed)]


@_not_autograph
def allreduce(tensor, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression=Compression.none,
              op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Exact reduction across the set's ranks (a new tensor); for metrics and state."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set)[0]


def _leading_unknown(t: tf.Tensor) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else \
        tf.TensorShape([None])


@_not_autograph
def grouped_allgather(tensors: Sequence, name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Concatenate every rank's tensors along dimension 0 (sizes may differ there)."""
    @tf.custom_gradient
    def gather(*xs):
        def grad(*dys):
            reduced = _reduce([tf.convert_to_tensor(d) for d in dys], Average, 1.0, 1.0,
                              process_set)
            rows = [tf.reshape(tf.shape(x)[0] if x.shape.rank else 1, [1]) for x in xs]
            everyone = grouped_allgather(rows, process_set=process_set)
            me = process_set.rank()
            return [tf.reshape(r[tf.reduce_sum(e[:me]):tf.reduce_sum(e[:me + 1])], tf.shape(x))
                    for r, e, x in zip(reduced, everyone, xs)]
        return _run("allgather", lambda arrays, names: collectives.grouped_allgather_async(
            arrays, name, process_set, names), xs, [_leading_unknown(x) for x in xs]), grad
    return list(gather(*[tf.convert_to_tensor(t) for t in tensors]))


def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ there)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def _broadcast_all(tensors: Sequence, root_rank: int, name: Optional[str],
                   process_set: ProcessSet) -> list[tf.Tensor]:
    @tf.custom_gradient
    def bcast(*xs):
        def grad(*dys):
            reduced = _reduce([tf.convert_to_tensor(d) for d in dys], Average, 1.0, 1.0,
                              process_set)
            return reduced if rank() == root_rank else [r * 0 for r in reduced]
        return _run("broadcast", lambda arrays, names: collectives.grouped_broadcast_async(
            arrays, root_rank, name, process_set, names), xs, [x.shape for x in xs]), grad
    return list(bcast(*[tf.convert_to_tensor(t) for t in tensors]))


@_not_autograph
def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The global rank ``root_rank``'s value of ``tensor`` on every rank of the set."""
    return _broadcast_all([tensor], root_rank, name, process_set)[0]


@_not_autograph
def broadcast_variables(variables: Sequence, root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False):
    """Assign root's values to ``variables`` (one negotiated broadcast for all of them).

    Eagerly it returns None; in a graph, the op that groups the assignments.
    """
    variables = list(variables)
    if not variables:
        return None
    values = _broadcast_all([tf.convert_to_tensor(v) for v in variables], root_rank, None,
                            process_set)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


@_not_autograph
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tuple[tf.Tensor, tf.Tensor]:
    """Send rows ``splits[j]`` of dimension 0 to set rank j; returns (rows received, counts
    received from each rank), as horovod.tensorflow does."""
    t = tf.convert_to_tensor(tensor)
    n = process_set.size() if process_set.size() is not None else 0

    @tf.custom_gradient
    def exchange(x):
        inputs = [bridge.widened(x)] + ([] if splits is None else [tf.cast(splits, tf.int64)])

        def run(array, split_array=None):
            out, received = collectives.alltoall_async(array, split_array, name, process_set,
                                                       x.dtype.name).wait()
            return [out, received.astype(np.int32)]
        out, received = bridge.call(run, inputs, [inputs[0].dtype, tf.int32],
                                    [_leading_unknown(x), [n]], "hvd_sgp alltoall")

        def grad(dy, _):
            back, _ = alltoall(dy, received, process_set=process_set)
            return back
        return (tf.cast(out, x.dtype), received), grad
    return exchange(t)


def _scatter(tensors: Sequence[tf.Tensor], op: ReduceOp, prescale: float, postscale: float,
             process_set: ProcessSet) -> list[tf.Tensor]:
    @tf.custom_gradient
    def scatter(*xs):
        def grad(*dys):
            scale = (process_set.size() if op == Sum else 1) * prescale * postscale
            return grouped_allgather([tf.convert_to_tensor(d) * tf.cast(scale, d.dtype)
                                      for d in dys], process_set=process_set)
        return _run("reducescatter", lambda arrays, names:
                    collectives.grouped_reducescatter_async(arrays, op, prescale, postscale,
                                                            None, process_set, names),
                    xs, [_leading_unknown(x) for x in xs]), grad
    return list(scatter(*tensors))


@_not_autograph
def grouped_reducescatter(tensors: Sequence, device_dense: str = "",
                          compression=Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reduce across the set; rank r keeps its rows of dimension 0 (earlier ranks take the
    remainder)."""
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    out = _scatter([c for c, _ in compressed], ReduceOp(op), prescale_factor, postscale_factor,
                   process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, compressed)]


@_not_autograph
def reducescatter(tensor, device_dense: str = "", compression=Compression.none,
                  op: ReduceOp = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce across the set; rank r keeps its rows of dimension 0 (earlier ranks take the
    remainder)."""
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Any picklable object from the global rank ``root_rank`` (call eagerly)."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's object, in set-rank order (call eagerly)."""
    return collectives.allgather_object(obj, name, process_set)


__all__ = list(_basics) + [
    "nccl_built", "cuda_built", "rocm_built", "allreduce", "grouped_allreduce", "allgather",
    "grouped_allgather", "broadcast", "broadcast_variables", "alltoall", "reducescatter",
    "grouped_reducescatter", "broadcast_object", "allgather_object", "Compression",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]
