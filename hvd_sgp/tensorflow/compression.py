"""Horovod's Compression for TF tensors, plus bf16.

Exact collectives cast floating tensors before and after the reduction. For SGP gossip the same
choice sets the core's wire codec: parameters travel as 16-bit words, the PushSum weight exact.
"""
from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: compress a tensor for the wire, decompress with the returned context."""

    wire = "none"

    @staticmethod
    def compress(tensor: tf.Tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx) -> tf.Tensor:
        return tensor


class NoneCompressor(Compressor):
    pass


class _CastCompressor(Compressor):
    dtype: tf.DType

    @classmethod
    def compress(cls, tensor: tf.Tensor):
        if tensor.dtype.is_floating:
            return tf.cast(tensor, cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    wire = "fp16"
    dtype = tf.float16


class BF16Compressor(_CastCompressor):
    wire = "bf16"
    dtype = tf.bfloat16


class Compression:
    """Choices for ``compression=``, as in horovod.tensorflow."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
