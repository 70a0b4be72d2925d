"""Horovod's Compression for torch tensors, plus bf16.

For exact collectives the compressor casts before and after the reduction (16-bit reductions
run in float32 inside MPI). For SGP gossip the same choice sets the wire codec: parameters
travel as 16-bit words and the PushSum weight travels exact.
"""
from __future__ import annotations

import torch


class Compressor:
    """Interface: compress a tensor for the wire, decompress with the returned context."""

    wire = "none"

    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    pass


class _CastCompressor(Compressor):
    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    wire = "fp16"
    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    wire = "bf16"
    dtype = torch.bfloat16


class Compression:
    """Choices for ``compression=``, as in horovod.torch."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
