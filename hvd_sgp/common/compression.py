"""Wire codecs for gossip messages: parameters travel as fp16 or bf16, the weight stays exact.

A compressed message is a uint16 array: the encoded parameters, then the float64 PushSum
weight's four 16-bit words. Receivers decode and accumulate in the buffer's own precision.
"""
from __future__ import annotations

import numpy as np

WEIGHT_WORDS = 4  # one float64 in uint16 words


class Codec:
    """Identity: messages are the buffer itself (no copy)."""

    name = "none"

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def decode(self, words: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class FP16Codec(Codec):
    name = "fp16"

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float16)[...] = values

    def decode(self, words: np.ndarray) -> np.ndarray:
        return words.view(np.float16)


class BF16Codec(Codec):
    """bfloat16 by bit arithmetic (round to nearest even), so numpy needs no bf16 type."""

    name = "bf16"

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        out[...] = (rounded >> np.uint32(16)).astype(np.uint16)

    def decode(self, words: np.ndarray) -> np.ndarray:
        return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


CODECS = {"none": None, "fp16": FP16Codec(), "bf16": BF16Codec()}


def pack(codec: Codec, values: np.ndarray, weight: float, out: np.ndarray) -> None:
    """Encode values into out[:-4] and the exact weight into out[-4:]."""
    codec.encode(values, out[:-WEIGHT_WORDS])
    out[-WEIGHT_WORDS:].view(np.float64)[0] = weight


def unpack(codec: Codec, message: np.ndarray) -> tuple[np.ndarray, float]:
    return codec.decode(message[:-WEIGHT_WORDS]), float(message[-WEIGHT_WORDS:].view(np.float64)[0])


class Compressor:
    """Horovod's compressor interface for framework tensors: ``compress`` returns the tensor
    for the wire and a context, ``decompress`` undoes it. ``wire`` names the gossip codec."""

    wire = "none"

    @classmethod
    def compress(cls, tensor):
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor


class CastCompressor(Compressor):
    """Casts floating tensors to ``dtype`` and back; a framework supplies ``cast`` and
    ``is_floating``."""

    dtype = None

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError

    @staticmethod
    def is_floating(tensor) -> bool:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor):
            return cls.cast(tensor, cls.dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return cls.cast(tensor, ctx) if ctx is not None else tensor
