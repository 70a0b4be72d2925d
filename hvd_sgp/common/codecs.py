"""Wire formats for gossip messages.

A codec owns its format: how many bytes n values take, and encode/decode between a float array
and those bytes. Every encoded message is bytes (uint8): the codec's part, then the PushSum
weight as an exact float64 (8 bytes), so the de-bias never suffers from compression. Receivers
decode and accumulate in the buffer's own precision. ``REGISTRY`` holds one class per codec;
each framework's ``Compression`` namespace is generated from it, so a new codec is one class.
"""
from __future__ import annotations

from typing import ClassVar, Union

import numpy as np

from hvd_sgp.common.errors import OptionError

WEIGHT_BYTES = 8  # one float64


class Codec:
    """Identity: messages are the buffer itself (no copy, no wire format)."""

    name: ClassVar[str] = "none"
    exact: ClassVar[bool] = True  # decode(encode(x)) == x: the mixer sends the buffer itself
    cast: ClassVar[str] = ""  # numpy dtype name a collective may cast to ("" = none)
    argument: ClassVar[str] = ""  # what ``name:ARG`` gives the constructor ("" = nothing)
    compressor: ClassVar[str] = "NoneCompressor"  # the Horovod-style class name per framework

    @property
    def spec(self) -> str:
        """The text that names this codec (``HVD_SGP_COMPRESSION`` syntax)."""
        return self.name

    def nbytes(self, n: int) -> int:
        """Bytes that n values take on the wire (without the weight)."""
        raise NotImplementedError

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        """Write ``values`` into the uint8 array ``out`` of nbytes(len(values))."""
        raise NotImplementedError

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        """The n values in ``data`` (a view where the format allows)."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"codec({self.spec!r})"


class FP16Codec(Codec):
    name, exact, cast, compressor = "fp16", False, "float16", "FP16Compressor"

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float16)[...] = values

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        return data.view(np.float16)


class BF16Codec(Codec):
    """bfloat16 by bit arithmetic (round to nearest even), so numpy needs no bf16 type."""

    name, exact, cast, compressor = "bf16", False, "bfloat16", "BF16Compressor"

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        out.view(np.uint16)[...] = (rounded >> np.uint32(16)).astype(np.uint16)

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class under its ``name`` (usable as a decorator)."""
    REGISTRY[cls.name] = cls
    return cls


for _cls in (Codec, FP16Codec, BF16Codec):
    register(_cls)


def codec(spec: Union[str, Codec, None]) -> Codec:
    """The codec named by ``spec`` ('none', 'fp16', 'bf16', ...; 'name:arg' for codecs that
    take an argument), or ``spec`` itself when it already is one."""
    if isinstance(spec, Codec):
        return spec
    text = "none" if spec is None else str(spec).strip().lower()
    name, sep, arg = text.partition(":")
    cls = REGISTRY.get(name)
    if cls is None:
        raise OptionError(f"unknown codec {spec!r}; choose one of {', '.join(REGISTRY)}")
    try:
        return cls(arg) if sep else cls()
    except TypeError:
        raise OptionError(f"codec {name!r} takes {'no' if sep else 'an'} argument, "
                            f"got {spec!r}") from None


def pack(c: Codec, values: np.ndarray, weight: float, out: np.ndarray) -> None:
    """Encode values into out[:-8] and the exact weight into out[-8:]."""
    c.encode(values, out[:-WEIGHT_BYTES])
    out[-WEIGHT_BYTES:].view(np.float64)[0] = weight


def unpack(c: Codec, message: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    """(values, weight) of a message written by pack()."""
    return (c.decode(message[:-WEIGHT_BYTES], n),
            float(message[-WEIGHT_BYTES:].view(np.float64)[0]))
