"""Wire formats for gossip messages.

A codec owns its format: how many bytes n values take, and encode/decode between a float array
and those bytes. Every encoded message is bytes (uint8): the codec's part, then the PushSum
weight as an exact float64 (8 bytes), so the de-bias never suffers from compression. Receivers
decode and accumulate in the buffer's own precision. ``REGISTRY`` holds one class per codec;
each framework's ``Compression`` namespace is generated from it, so a new codec is one class.

The 16-bit casts push the parameters themselves (their error is small). The lossy codecs
(``int8``, ``topk:F``, ``randomk:F``) are ``differential``: pushing their encoding of the
parameters would make the de-biased average drift, so the mixer gossips encoded differences
against public copies instead (choco.py). Every encoder is vectorized: no Python loop runs
over elements.
"""
from __future__ import annotations

import math
from typing import ClassVar, Optional, Union

import numpy as np

from hvd_sgp.common.errors import OptionError

WEIGHT_BYTES = 8  # one float64


class Codec:
    """Identity: messages are the buffer itself (no copy, no wire format)."""

    name: ClassVar[str] = "none"
    exact: ClassVar[bool] = True  # decode(encode(x)) == x: the mixer sends the buffer itself
    cast: ClassVar[str] = ""  # numpy dtype name a collective may cast to ("" = none)
    argument: ClassVar[str] = ""  # what ``name:ARG`` gives the constructor ("" = nothing)
    optional: ClassVar[bool] = False  # the argument may be left out (``int8``, ``int8:ARG``)
    compressor: ClassVar[str] = "NoneCompressor"  # the Horovod-style class name per framework
    differential: ClassVar[bool] = False  # gossiped as differences to public copies (choco.py)
    consensus_step: ClassVar[float] = 1.0  # the compressed gossip's default step (choco.py)

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

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        """``target += decode(data, n)``; sparse formats touch only the entries they carry."""
        target += self.decode(data, n)

    def finite(self, data: np.ndarray, n: int) -> bool:
        """No NaN or infinity in the message (checked on what it carries, not a dense copy)."""
        return bool(np.isfinite(self.decode(data, n)).all())

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


def _fraction(name: str, text: str) -> float:
    """The F of ``name:F``: a float in (0, 1]."""
    if any(cast in text for cast in ("fp16", "bf16", "float16")):
        raise OptionError(f"{name} sends float32 values and cannot use a 16-bit (fp16/bf16) "
                          f"wire; got {name}:{text}. Choose one codec")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise OptionError(f"{name} takes the fraction of entries to send, in (0, 1]; got "
                          f"{text!r}")
    return value


class _Sparse(Codec):
    """A fraction of the entries, as float32 values; subclasses say which entries."""

    argument = "F, the fraction of entries sent, in (0, 1]"
    exact, differential = False, True

    def __init__(self, fraction: "str | float"):
        self.fraction = _fraction(self.name, str(fraction))

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.fraction:g}"

    def count(self, n: int) -> int:
        """Entries sent out of n."""
        return min(n, max(1, math.ceil(self.fraction * n)))


class TopKCodec(_Sparse):
    """The k = ceil(F n) entries of largest magnitude, with their uint32 indices (8 bytes
    each). Selection is exact: a threshold from a sample keeps a few more than k candidates
    in one pass, and only those are partitioned (all of them when the sample undershoots)."""

    name, compressor = "topk", "TopKCompressor"

    def __init__(self, fraction: "str | float"):
        super().__init__(fraction)
        self._magnitude: Optional[np.ndarray] = None

    @property
    def consensus_step(self) -> float:
        """min(0.5, 3 sqrt(F)): a difference's energy sits in few entries, so top-k removes
        far more than F of it per push (0.3 at 1% measured best on the digits CNN at n = 8);
        above 0.5 the complete graph and the ring diverge in the simulator even from a common
        start (docs/compression.md)."""
        return min(0.5, 3 * math.sqrt(self.fraction))

    def nbytes(self, n: int) -> int:
        if n >= 2**32:
            raise OptionError(f"topk indexes with uint32: a shard of {n} values is too long")
        return 8 * self.count(n)

    def select(self, values: np.ndarray) -> np.ndarray:
        """Indices of the count(n) entries of largest magnitude (in no particular order)."""
        n, k = len(values), self.count(len(values))
        if self._magnitude is None or len(self._magnitude) != n:
            self._magnitude = np.empty(n, np.float32)
        magnitude = self._magnitude
        np.abs(values, out=magnitude, casting="unsafe")
        if k == n:
            return np.arange(n)
        stride = max(1, k // 1024)  # a sample where about 1024 entries beat the threshold
        sample = magnitude[::stride]
        expected = k * len(sample) / n
        rank = max(0, len(sample) - 1 - int(1.1 * expected + 4 * math.sqrt(expected) + 8))
        threshold = np.partition(sample, rank)[rank]
        candidates = np.flatnonzero(magnitude >= threshold)
        if len(candidates) < k:
            candidates = np.arange(n)
        top = np.argpartition(magnitude[candidates], len(candidates) - k)[len(candidates) - k:]
        return candidates[top]

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        k = self.count(len(values))
        index = self.select(values)
        out[:4 * k].view(np.uint32)[...] = index
        out[4 * k:8 * k].view(np.float32)[...] = values[index]

    def _parts(self, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.count(n)
        return data[:4 * k].view(np.uint32), data[4 * k:8 * k].view(np.float32)

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        index, values = self._parts(data, n)
        dense = np.zeros(n, np.float32)
        dense[index] = values
        return dense

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        index, values = self._parts(data, n)
        target[index] += values

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(self._parts(data, n)[1]).all())


class RandomKCodec(_Sparse):
    """k = ceil(F n) entries drawn at random (with replacement, so slightly fewer distinct):
    the message carries the 8-byte seed of the draw instead of indices (4 bytes per entry).
    Unscaled, as compressed gossip needs (a contraction, not an unbiased estimate)."""

    name, compressor = "randomk", "RandomKCompressor"

    @property
    def consensus_step(self) -> float:
        """F / 2: random-k removes only F of a difference's energy per push, and the
        error-feedback loop is stable only for gamma below that (CHOCO's condition)."""
        return self.fraction / 2

    def __init__(self, fraction: "str | float"):
        super().__init__(fraction)
        self._draws = 0

    def nbytes(self, n: int) -> int:
        return 8 + 4 * self.count(n)

    def _index(self, seed: int, n: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, n, self.count(n))

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        self._draws += 1
        out[:8].view(np.uint64)[0] = self._draws
        out[8:].view(np.float32)[...] = values[self._index(self._draws, len(values))]

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        dense = np.zeros(n, np.float32)
        self.add_to(data, n, dense)
        return dense

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        index = self._index(int(data[:8].view(np.uint64)[0]), n)
        target[index] += data[8:].view(np.float32)  # a repeated index is added once

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(data[8:].view(np.float32)).all())


class Int8Codec(Codec):
    """8-bit integers with one float32 scale per chunk of CHUNK values (max |v| / 127): about
    4x fewer bytes than float32. ``int8:stochastic`` rounds stochastically (unbiased) instead
    of to nearest."""

    name, compressor = "int8", "Int8Compressor"
    argument = "rounding: nearest (default) or stochastic"
    optional = True
    exact, differential = False, True
    CHUNK = 1024

    def __init__(self, rounding: str = "nearest"):
        if rounding not in ("nearest", "stochastic"):
            raise OptionError(f"int8 rounds to 'nearest' or 'stochastic', got {rounding!r}")
        self.rounding = rounding
        self._rng = np.random.default_rng(0) if rounding == "stochastic" else None

    @property
    def spec(self) -> str:
        return self.name if self.rounding == "nearest" else f"{self.name}:{self.rounding}"

    def _chunks(self, n: int) -> int:
        return -(-n // self.CHUNK)

    def nbytes(self, n: int) -> int:
        return n + 4 * self._chunks(n)

    def _rows(self, values: np.ndarray) -> list[tuple[slice, np.ndarray]]:
        """(chunk indices, values as rows of a chunk) for the full chunks and the tail."""
        n = len(values)
        full = n // self.CHUNK
        parts = [(slice(0, full), values[:full * self.CHUNK].reshape(full, self.CHUNK))]
        if full * self.CHUNK < n:
            parts.append((slice(full, full + 1), values[full * self.CHUNK:].reshape(1, -1)))
        return parts

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        chunks = self._chunks(len(values))
        scales = out[:4 * chunks].view(np.float32)
        codes = out[4 * chunks:].view(np.int8)
        for (index, rows), (_, target) in zip(self._rows(values), self._rows(codes)):
            if not rows.size:
                continue
            top = np.maximum(rows.max(axis=1), -rows.min(axis=1)) / 127
            scales[index] = top
            scaled = rows * (1 / np.where(top > 0, top, 1)).astype(np.float32)[:, None]
            if self._rng is not None:
                scaled += self._rng.random(scaled.shape, np.float32)
                np.floor(scaled, out=scaled)
                np.clip(scaled, -127, 127, out=scaled)  # 127 (1 + eps) + U may floor to 128
            else:
                np.rint(scaled, out=scaled)  # |scaled| <= 127 (1 + eps) rounds into range
            target[...] = scaled

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        chunks = self._chunks(n)
        scales = data[:4 * chunks].view(np.float32)
        codes = data[4 * chunks:4 * chunks + n].view(np.int8)
        for (index, rows), (_, into) in zip(self._rows(codes), self._rows(target)):
            if rows.size:
                into += rows * scales[index, None]

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        values = np.zeros(n, np.float32)
        self.add_to(data, n, values)
        return values

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(data[:4 * self._chunks(n)].view(np.float32)).all())


REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class under its ``name`` (usable as a decorator)."""
    REGISTRY[cls.name] = cls
    return cls


for _cls in (Codec, FP16Codec, BF16Codec, Int8Codec, TopKCodec, RandomKCodec):
    register(_cls)


def codec(spec: Union[str, Codec, None]) -> Codec:
    """The codec named by ``spec`` ('none', 'fp16', 'bf16', 'int8', ...; 'name:arg' for codecs
    that take an argument, e.g. 'topk:0.01'), or ``spec`` itself when it already is one."""
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
