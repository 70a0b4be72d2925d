"""SyncBatchNormalization: Horovod's Keras layer, BatchNormalization over the global batch.

In training, every rank normalises with the mean and variance of all ranks' batches together
(weighted by each rank's count, so batches may differ in size) and updates its moving
statistics with them, so they stay the same on every rank. The statistics are three sums (of
x, of x squared, of the count) reduced by one allreduce whose gradient is the allreduce of the
incoming gradients: backpropagation through the layer is that of one BatchNormalization on the
concatenated batch. It subclasses the process's Keras BatchNormalization (flavour.py).
"""
from __future__ import annotations

import tensorflow as tf

from hvd_sgp.common import runtime
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.common.horovod_api.collectives import ReduceOp
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.tensorflow import bridge, flavour


def _sum_over_ranks(tensor: tf.Tensor) -> tf.Tensor:
    out, = bridge.call(lambda a: [collectives.allreduce(a, ReduceOp.Sum)], [tensor],
                       [tensor.dtype], [tensor.shape], "hvd_sgp sync_batch_norm")
    return out


@tf.custom_gradient
def _differentiable_sum(tensor: tf.Tensor):
    """Sum over ranks; its gradient is the sum over ranks of the incoming gradients."""
    return _sum_over_ranks(tensor), _sum_over_ranks


def global_moments(inputs: tf.Tensor, axes, mask=None, keepdims: bool = False):
    """Mean and (biased) variance of ``inputs`` over ``axes`` and over all ranks' batches;
    ``mask`` (inputs' shape without the last axis) weighs the entries as Keras' does."""
    x = tf.cast(inputs, tf.float32)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, tf.float32), -1), tf.shape(x))
    totals = _differentiable_sum(tf.stack([
        tf.reduce_sum(x * weights, axes, keepdims=keepdims),
        tf.reduce_sum(tf.square(x) * weights, axes, keepdims=keepdims),
        tf.reduce_sum(weights, axes, keepdims=keepdims)]))
    count = tf.maximum(totals[2], 1.0)
    mean = totals[0] / count
    variance = tf.maximum(totals[1] / count - tf.square(mean), 0.0)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


def _synchronised() -> bool:
    return runtime.is_initialized() and runtime.size() > 1


@flavour.keras.utils.register_keras_serializable(package="hvd_sgp")
class SyncBatchNormalization(flavour.keras.layers.BatchNormalization):
    """Horovod's SyncBatchNormalization (see the module docstring); ``fused`` must stay
    False, as in Horovod."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise SgpValueError("SyncBatchNormalization does not support fused=True.")
        if flavour.LEGACY:
            kwargs["fused"] = fused
        super().__init__(**kwargs)

    if flavour.LEGACY:  # tf_keras' hook
        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            if not _synchronised():
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask)
            return global_moments(inputs, reduction_axes, mask, keep_dims)
    else:  # Keras 3's
        def _moments(self, inputs, mask):
            if not _synchronised():
                return super()._moments(inputs, mask)
            return global_moments(inputs, self._reduction_axes, mask)
