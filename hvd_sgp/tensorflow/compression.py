"""Horovod's Compression for TF tensors, plus bf16.

Exact collectives cast floating tensors before and after the reduction. For SGP gossip the same
choice sets the core's wire codec: parameters travel as 16-bit words, the PushSum weight exact.
"""
from __future__ import annotations

import tensorflow as tf

from hvd_sgp.common.compression import CastCompressor, Compressor


class NoneCompressor(Compressor):
    pass


class _TFCast(CastCompressor):
    @staticmethod
    def cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        return tf.cast(tensor, dtype)

    @staticmethod
    def is_floating(tensor: tf.Tensor) -> bool:
        return tensor.dtype.is_floating


class FP16Compressor(_TFCast):
    wire, dtype = "fp16", tf.float16


class BF16Compressor(_TFCast):
    wire, dtype = "bf16", tf.bfloat16


class Compression:
    """Choices for ``compression=``, as in horovod.tensorflow."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
