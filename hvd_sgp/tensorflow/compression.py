"""Horovod's Compression for TF tensors, generated from the core's codec registry.

Exact collectives cast floating tensors before and after the reduction. For SGP gossip the
same choice names the core's wire codec: parameters travel encoded, the PushSum weight exact.
"""
from __future__ import annotations

import tensorflow as tf

from hvd_sgp.common.horovod_api.compression import Compressor, namespace

Compression, _classes = namespace(
    "Choices for ``compression=``, as in horovod.tensorflow.",
    lambda tensor, dtype: tf.cast(tensor, dtype), lambda tensor: tensor.dtype.is_floating,
    {"float16": tf.float16, "bfloat16": tf.bfloat16})
globals().update(_classes)  # NoneCompressor, FP16Compressor, ... as horovod.tensorflow.compression

# numpy <-> tensors, for a script's own Compressor used as the gossip codec
TENSORS = (tf.constant, lambda tensor: tensor.numpy())

__all__ = ["Compression", "Compressor", *_classes]
