"""Horovod's Compression for torch tensors, plus bf16.

For exact collectives the compressor casts before and after the reduction (16-bit reductions
run in float32 inside MPI). For SGP gossip the same choice sets the wire codec: parameters
travel as 16-bit words and the PushSum weight travels exact.
"""
from __future__ import annotations

import torch

from hvd_sgp.common.compression import CastCompressor, Compressor


class NoneCompressor(Compressor):
    pass


class _TorchCast(CastCompressor):
    @staticmethod
    def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor.to(dtype)

    @staticmethod
    def is_floating(tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point


class FP16Compressor(_TorchCast):
    wire, dtype = "fp16", torch.float16


class BF16Compressor(_TorchCast):
    wire, dtype = "bf16", torch.bfloat16


class Compression:
    """Choices for ``compression=``, as in horovod.torch."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
