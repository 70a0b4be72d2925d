"""Running numpy code (the MPI core) from TensorFlow, eagerly or inside a ``tf.function``.

Eagerly the function runs on the tensors' numpy values. In a graph it becomes one stateful
``tf.numpy_function`` op: TensorFlow's automatic control dependencies chain stateful ops that
touch no resource in program order, so every rank issues its MPI calls in the same order even
when the executor could run independent ops in parallel. Outputs get their static shapes back
with ``tf.ensure_shape``. Device tensors go through host memory (the op runs on the CPU).
XLA cannot compile a Python callback, so tracing one under XLA raises a clear error.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from hvd_sgp.common.errors import SgpValueError

# 16-bit floats are reduced in float32: MPI has no half-precision types.
_WIDEN = {tf.float16, tf.bfloat16}


def check_not_xla(what: str) -> None:
    """Raise when tracing under XLA (jit_compile=True), which cannot call back into Python."""
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()):
        raise SgpValueError(
            f"{what} calls MPI through a Python op that XLA cannot compile; use "
            "model.compile(..., jit_compile=False) or tf.function(jit_compile=False)")


def call(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
         dtypes: Sequence[tf.DType], shapes: Sequence, what: str) -> list[tf.Tensor]:
    """``fn(*numpy_inputs) -> numpy outputs`` as TF tensors of ``dtypes`` and ``shapes``."""
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    if tf.executing_eagerly():
        outputs = fn(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(np.asarray(o), dtype=d) for o, d in zip(outputs, dtypes)]
    check_not_xla(what)
    outputs = tf.numpy_function(lambda *a: [np.asarray(o) for o in fn(*a)], inputs,
                                list(dtypes), stateful=True, name=what.replace(" ", "_"))
    return [tf.ensure_shape(o, s) for o, s in zip(outputs, shapes)]


def widened(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor in a dtype MPI can reduce (float16/bfloat16 become float32)."""
    return tf.cast(tensor, tf.float32) if tensor.dtype in _WIDEN else tensor


def dense(value) -> tf.Tensor:
    """IndexedSlices (embedding gradients) as a dense tensor: one fused message per dtype."""
    return tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value


def flatten(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """One flat tensor from several of one dtype."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def unflatten(flat: tf.Tensor, shapes: Sequence[tf.TensorShape]) -> list[tf.Tensor]:
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    return [tf.reshape(part, s) for part, s in zip(tf.split(flat, sizes), shapes)]
