"""Horovod's Compression for torch tensors, generated from the core's codec registry.

For exact collectives a cast compressor casts before and after the reduction (16-bit
reductions run in float32 inside MPI). For SGP gossip the same choice names the wire codec:
parameters travel encoded and the PushSum weight travels exact.
"""
from __future__ import annotations

import torch

from hvd_sgp.common.horovod_api.compression import Compressor, namespace

Compression, _classes = namespace(
    "Choices for ``compression=``, as in horovod.torch.",
    lambda tensor, dtype: tensor.to(dtype), lambda tensor: tensor.dtype.is_floating_point,
    {"float16": torch.float16, "bfloat16": torch.bfloat16})
globals().update(_classes)  # NoneCompressor, FP16Compressor, ... as horovod.torch.compression

# numpy <-> tensors, for a script's own Compressor used as the gossip codec
TENSORS = (torch.from_numpy, lambda tensor: tensor.detach().cpu().numpy())

__all__ = ["Compression", "Compressor", *_classes]
