"""horovod.tensorflow's basics and exact collectives on TF tensors, through the numpy core.

Every collective works eagerly and inside ``tf.function`` (see bridge.py). These are for
metrics, broadcasts and state; training itself gossips through DistributedOptimizer or
DistributedGradientTape. Sparse tensors (IndexedSlices) are densified; 16-bit floats are
reduced in float32.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvd_sgp.common import collectives
from hvd_sgp.common.basics import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.common.basics import (Average, ProcessSet, ReduceOp, check_process_set,
                                   global_process_set, resolve_op, size)
from hvd_sgp.common.basics import __all__ as _basics
from hvd_sgp.tensorflow import bridge
from hvd_sgp.tensorflow.compression import Compression

# Traced as they are: AutoGraph would otherwise try (and warn) to convert mpi4py's methods.
_not_autograph = tf.autograph.experimental.do_not_convert

def nccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return tf.test.is_built_with_cuda()


def rocm_built() -> bool:
    return tf.test.is_built_with_rocm()


@_not_autograph
def grouped_allreduce(tensors: Sequence, average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression=Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Exact reductions of several tensors in one bridge call (one op in a graph)."""
    check_process_set(process_set)
    reduction = resolve_op(average, op)
    compressed = [compression.compress(bridge.dense(t)) for t in tensors]
    wide = [bridge.widened(c) for c, _ in compressed]

    def reduce_all(*arrays):
        return [collectives.allreduce(a, reduction, prescale_factor, postscale_factor)
                for a in arrays]

    out = bridge.call(reduce_all, wide, [w.dtype for w in wide], [w.shape for w in wide],
                      "hvd_sgp allreduce")
    return [compression.decompress(tf.cast(o, c.dtype), ctx)
            for o, (c, ctx) in zip(out, compressed)]


@_not_autograph
def allreduce(tensor, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression=Compression.none,
              op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Exact reduction across ranks (a new tensor); for metrics and state, not gradients."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set)[0]


@_not_autograph
def allgather(tensor, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0 (sizes may differ there)."""
    check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    wide = bridge.widened(t)
    shape = tf.TensorShape([None]).concatenate(t.shape[1:]) if t.shape.rank else [None]
    out, = bridge.call(lambda a: [collectives.allgather(a)], [wide], [wide.dtype], [shape],
                       "hvd_sgp allgather")
    return tf.cast(out, t.dtype)


@_not_autograph
def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Root's value of ``tensor`` on every rank."""
    return _broadcast_all([tensor], root_rank, process_set)[0]


def _broadcast_all(tensors: Sequence, root_rank: int,
                   process_set: ProcessSet) -> list[tf.Tensor]:
    check_process_set(process_set)
    originals = [tf.convert_to_tensor(t) for t in tensors]
    wide = [bridge.widened(t) for t in originals]
    out = bridge.call(lambda *arrays: [collectives.broadcast(a, root_rank) for a in arrays],
                      wide, [w.dtype for w in wide], [w.shape for w in wide],
                      "hvd_sgp broadcast")
    return [tf.cast(o, t.dtype) for o, t in zip(out, originals)]


@_not_autograph
def broadcast_variables(variables: Sequence, root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False):
    """Assign root's values to ``variables`` (one bridge call for all of them).

    Eagerly it returns None; in a graph, the op that groups the assignments.
    """
    variables = list(variables)
    if not variables:
        return None
    values = _broadcast_all(variables, root_rank, process_set)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


@_not_autograph
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tuple[tf.Tensor, tf.Tensor]:
    """Send rows ``splits[j]`` of dimension 0 to rank j; returns (rows received, counts
    received from each rank), as horovod.tensorflow does."""
    check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    wide = bridge.widened(t)
    inputs = [wide] if splits is None else [wide, tf.cast(splits, tf.int64)]

    def exchange(array, split_array=None):
        out, received = collectives.alltoall(array, split_array)
        return [out, received.astype(np.int32)]

    shape = tf.TensorShape([None]).concatenate(t.shape[1:])
    out, received = bridge.call(exchange, inputs, [wide.dtype, tf.int32],
                                [shape, [size()]], "hvd_sgp alltoall")
    return tf.cast(out, t.dtype), received


@_not_autograph
def reducescatter(tensor, device_dense: str = "", compression=Compression.none,
                  op: ReduceOp = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce across ranks; rank r keeps its slice of dimension 0 (earlier ranks take the
    remainder)."""
    check_process_set(process_set)
    reduction = resolve_op(None, op)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    wide = bridge.widened(compressed)
    if prescale_factor != 1.0:
        wide = wide * tf.cast(prescale_factor, wide.dtype)
    shape = tf.TensorShape([None]).concatenate(wide.shape[1:])
    out, = bridge.call(lambda a: [collectives.reducescatter(a, reduction)], [wide],
                       [wide.dtype], [shape], "hvd_sgp reducescatter")
    if postscale_factor != 1.0:
        out = out * tf.cast(postscale_factor, out.dtype)
    return compression.decompress(tf.cast(out, compressed.dtype), ctx)


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Any picklable object from root (call eagerly)."""
    check_process_set(process_set)
    return collectives.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, session=None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's object, in rank order (call eagerly)."""
    check_process_set(process_set)
    return collectives.allgather_object(obj)


__all__ = list(_basics) + [
    "nccl_built", "cuda_built", "rocm_built", "allreduce", "grouped_allreduce", "allgather",
    "broadcast", "broadcast_variables", "alltoall", "reducescatter", "broadcast_object",
    "allgather_object", "Compression",
]
