"""Wire formats for gossip messages.

A codec owns its format: how many bytes n values take, and encode/decode between a float array
and those bytes. Every encoded message is bytes (uint8): the codec's part, then the PushSum
weight as an exact float64 (8 bytes), so the de-bias never suffers from compression. Receivers
decode and accumulate in the buffer's own precision. ``REGISTRY`` holds one class per codec;
each framework's ``Compression`` namespace is generated from it, so a new codec is one class.

The 16-bit casts push the parameters themselves (their error is small). The lossy codecs
(``int8``, ``topk:F``, ``randomk:F``) are ``differential``: pushing their encoding of the
parameters would make the de-biased average drift, so the mixer gossips encoded differences
against public copies instead (choco.py), or for random-k exact values on entries every node
draws alike (sparse.py; mixers.py chooses). Every encoder is vectorized, and the ones that
compressed gossip runs each step work block by block in one pass over memory: no Python loop
runs over elements, and no model-sized temporary is allocated.
"""
from __future__ import annotations

import math
from typing import ClassVar, Iterator, Optional, Union

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

    def __init__(self) -> None:
        self._work: dict[tuple[np.dtype, int], np.ndarray] = {}

    @property
    def spec(self) -> str:
        """The text that names this codec (``HVD_SGP_COMPRESSION`` syntax)."""
        return self.name

    def work(self, dtype, slot: int = 0) -> np.ndarray:
        """A reused block-sized scratch array (``slot`` tells several apart), for codecs
        that work block by block."""
        key = (np.dtype(dtype), slot)
        if key not in self._work:
            self._work[key] = np.empty(BLOCK, dtype)
        return self._work[key]

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
    """bfloat16 by bit arithmetic (round to nearest even), so numpy needs no bf16 type.
    Encoding runs block by block (no model-sized temporaries: 110 ms at 25.6M values when
    whole, measured); decoding widens into one reused array (``decode``'s result is valid
    until the next decode: every caller consumes a message before decoding the next)."""

    name, exact, cast, compressor = "bf16", False, "bfloat16", "BF16Compressor"

    def __init__(self) -> None:
        super().__init__()
        self._decoded = np.empty(0, np.float32)

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        codes, work = out.view(np.uint16), self.work(np.uint32)
        for start, stop in blocks(len(values)):
            block = np.ascontiguousarray(values[start:stop], dtype=np.float32)
            bits, tie = block.view(np.uint32), work[:stop - start]
            np.right_shift(bits, 16, out=tie)
            tie &= np.uint32(1)
            tie += np.uint32(0x7FFF)
            tie += bits
            tie >>= np.uint32(16)
            codes[start:stop] = tie

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        if len(self._decoded) != n:
            self._decoded = np.empty(n, np.float32)
        np.left_shift(data.view(np.uint16), np.uint32(16), out=self._decoded.view(np.uint32),
                      dtype=np.uint32)
        return self._decoded


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


BLOCK = 1 << 16  # values per block of a fused pass: a block's temporaries stay in cache


def blocks(n: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the blocks that cover n values."""
    for start in range(0, n, BLOCK):
        yield start, min(n, start + BLOCK)


class _Lossy(Codec):
    """A codec that compressed gossip moves public copies with (choco.py): it encodes the
    difference between the parameters and a reference without forming it, and adds what a
    message decodes to into a copy, both block by block (no model-sized temporary)."""

    exact, differential = False, True

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        self.encode_delta(values, None, out)

    def encode_delta(self, values: np.ndarray, reference: Optional[np.ndarray],
                     out: np.ndarray, copy: Optional[np.ndarray] = None,
                     seed: int = 0) -> None:
        """Write the encoding of ``values - reference`` (``values`` when None) into ``out``,
        and add what it decodes to into ``copy`` (a public copy, possibly ``reference``
        itself), as a receiver's ``add_to`` does. ``seed`` draws random choices."""
        raise NotImplementedError

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        dense = np.zeros(n, np.float32)
        self.add_to(data, n, dense)
        return dense


class _Sparse(_Lossy):
    """A fraction of the entries, as float32 values; subclasses say which entries."""

    argument = "F, the fraction of entries sent, in (0, 1]"

    def __init__(self, fraction: "str | float"):
        super().__init__()
        self.fraction = _fraction(self.name, str(fraction))

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.fraction:g}"

    def count(self, n: int) -> int:
        """Entries sent out of n."""
        return min(n, max(1, math.ceil(self.fraction * n)))


class TopKCodec(_Sparse):
    """The k = ceil(F n) entries of largest magnitude, with their uint32 indices (8 bytes
    each), ties broken by position. Selection is exact and takes about one pass: a threshold
    from a strided sample keeps a few more than k candidates, gathered block by block, and
    only those are partitioned."""

    name, compressor = "topk", "TopKCompressor"

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

    def select(self, values: np.ndarray, reference: Optional[np.ndarray] = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """(indices in increasing order, values) of the count(n) entries of ``values -
        reference`` of largest magnitude."""
        n, k = len(values), self.count(len(values))
        if k == n:
            return np.arange(n), _difference(values, reference, slice(0, n))
        stride = max(1, k // 1024)  # a sample where about 1024 entries beat the threshold
        sample = np.abs(_difference(values, reference, slice(None, None, stride)))
        expected = k * len(sample) / n
        rank = max(0, len(sample) - 1 - int(1.1 * expected + 4 * math.sqrt(expected) + 8))
        threshold = np.partition(sample, rank)[rank]
        index, kept = self._scan(values, reference, threshold, np.greater)
        if len(index) >= k:
            return _largest(index, kept, k)
        # too few beat the sample's threshold (ties at it, or an unlucky sample): the entries
        # equal to it, in order, complete the set when there are enough of them
        ties, tied = self._scan(values, reference, threshold, np.equal, k - len(index))
        if len(index) + len(ties) < k:  # the k-th largest lies below the threshold
            magnitude = np.abs(_difference(values, reference, slice(0, n)))
            kth = np.partition(magnitude, n - k)[n - k]
            index, kept = self._scan(values, reference, kth, np.greater)
            ties, tied = self._scan(values, reference, kth, np.equal, k - len(index))
        order = np.argsort(np.concatenate([index, ties]), kind="stable")
        return (np.concatenate([index, ties])[order], np.concatenate([kept, tied])[order])

    def _scan(self, values, reference, threshold, compare, limit: Optional[int] = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Indices and differences of the entries whose magnitude ``compare``s true with the
        threshold, in order, block by block; stops after ``limit`` of them."""
        difference, magnitude = self.work(values.dtype, 0), self.work(values.dtype, 1)
        mask = self.work(np.bool_)
        found, kept, count = [], [], 0
        for start, stop in blocks(len(values)):
            d, m, hit = difference[:stop - start], magnitude[:stop - start], mask[:stop - start]
            if reference is None:
                d[...] = values[start:stop]
            else:
                np.subtract(values[start:stop], reference[start:stop], out=d)
            np.abs(d, out=m)
            compare(m, threshold, out=hit)
            where = np.flatnonzero(hit)
            if limit is not None:
                where = where[:limit - count]
            found.append(where + start)
            kept.append(d[where])
            count += len(where)
            if limit is not None and count >= limit:
                break
        return (np.concatenate(found) if found else np.zeros(0, np.int64),
                np.concatenate(kept) if kept else np.zeros(0, values.dtype))

    def encode_delta(self, values, reference, out, copy=None, seed=0) -> None:
        k = self.count(len(values))
        index, kept = self.select(values, reference)
        out[:4 * k].view(np.uint32)[...] = index
        out[4 * k:8 * k].view(np.float32)[...] = kept
        if copy is not None:
            self.add_to(out, len(values), copy)

    def _parts(self, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        k = self.count(n)
        return data[:4 * k].view(np.uint32), data[4 * k:8 * k].view(np.float32)

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        index, values = self._parts(data, n)
        np.add.at(target, index.astype(np.intp), values)  # unique indices: 6x a fancy +=

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(self._parts(data, n)[1]).all())


class RandomKCodec(_Sparse):
    """About k = ceil(F n) entries at random, as runs of a few consecutive entries (each entry
    is still chosen with probability F, and runs are gathered at memory speed): the message
    carries the 8-byte seed of the draw instead of indices. Nodes that draw with the same seed
    (the iteration) pick the same entries, which random-k gossip builds on (sparse.py)."""

    name, compressor = "randomk", "RandomKCompressor"

    @property
    def consensus_step(self) -> float:
        """F / 2, where random-k is forced through compressed gossip (the simulator's
        ``compressed=True``; it normally gossips exactly, sparse.py): a push removes only F
        of a difference's energy, and the error-feedback loop is stable only for gamma below
        that (CHOCO's condition)."""
        return self.fraction / 2

    @staticmethod
    def run(n: int) -> int:
        """Entries per run: 1 for small shards, up to 64 (a 256-byte stretch) for large."""
        return min(64, max(1, n // 4096))

    def runs(self, n: int) -> tuple[int, int]:
        """(runs drawn, runs in all) for n entries."""
        runs = -(-n // self.run(n))
        return min(runs, max(1, math.ceil(self.fraction * runs))), runs

    def count(self, n: int) -> int:
        """The most entries a draw holds (its last run may be cut short by the shard's end)."""
        return self.runs(n)[0] * self.run(n)

    def nbytes(self, n: int) -> int:
        return 8 + 4 * self.count(n)

    def draw(self, seed: int, n: int) -> Draw:
        """The entries that ``seed`` picks out of n."""
        drawn, runs = self.runs(n)
        chosen = np.random.default_rng(seed).choice(runs, drawn, replace=False)
        return Draw(np.sort(chosen), self.run(n), n)

    def encode_delta(self, values, reference, out, copy=None, seed=0) -> None:
        draw = self.draw(seed, len(values))
        out[:8].view(np.uint64)[0] = seed
        payload = out[8:].view(np.float32)
        payload[draw.size:] = 0
        if reference is None:
            draw.gather(values, payload[:draw.size])
        else:  # the difference in the values' precision, then rounded
            np.subtract(draw.gather(values), draw.gather(reference), out=payload[:draw.size],
                        casting="unsafe")
        if copy is not None:
            draw.add(copy, payload[:draw.size])

    def seed(self, data: np.ndarray) -> int:
        return int(data[:8].view(np.uint64)[0])

    def values(self, data: np.ndarray, n: int) -> tuple[Draw, np.ndarray]:
        """The draw a message was encoded with, and its values."""
        draw = self.draw(self.seed(data), n)
        return draw, data[8:8 + 4 * draw.size].view(np.float32)

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        draw, values = self.values(data, n)
        draw.add(target, values)

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(data[8:].view(np.float32)).all())


class Draw:
    """The entries random-k picked: ``chosen`` runs (sorted) of ``run`` consecutive entries
    of n, the last run possibly cut short. Gathers and adds move whole runs."""

    def __init__(self, chosen: np.ndarray, run: int, n: int):
        self.run, self.n = run, n
        self.runs = chosen  # every run drawn, the short last one included
        self.full = n // run  # runs that are whole
        self.cut = len(chosen) and chosen[-1] == self.full  # the short last run is drawn
        self.chosen = chosen[:-1] if self.cut else chosen
        self.size = len(self.chosen) * run + (n - self.full * run if self.cut else 0)

    def spread(self, per_run: np.ndarray) -> np.ndarray:
        """One value per run drawn (in ``runs`` order), repeated over the run's entries."""
        whole = np.repeat(per_run[:len(self.chosen)], self.run)
        if not self.cut:
            return whole
        return np.concatenate([whole, np.full(self.n - self.full * self.run, per_run[-1])])

    def _rows(self, a: np.ndarray) -> np.ndarray:
        return a[:self.full * self.run].reshape(self.full, self.run)

    def gather(self, a: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """a's drawn entries, in order (into ``out`` where given)."""
        out = np.empty(self.size, a.dtype) if out is None else out
        whole = len(self.chosen) * self.run
        rows = out[:whole].reshape(-1, self.run)
        if out.dtype == a.dtype:
            np.take(self._rows(a), self.chosen, axis=0, out=rows)
        else:
            rows[...] = self._rows(a)[self.chosen]
        if self.cut:
            out[whole:] = a[self.full * self.run:]
        return out

    def add(self, a: np.ndarray, values: np.ndarray) -> None:
        """a's drawn entries += values."""
        whole = len(self.chosen) * self.run
        self._rows(a)[self.chosen] += values[:whole].reshape(-1, self.run)
        if self.cut:
            a[self.full * self.run:] += values[whole:]

    def set(self, a: np.ndarray, values: np.ndarray) -> None:
        """a's drawn entries = values."""
        whole = len(self.chosen) * self.run
        self._rows(a)[self.chosen] = values[:whole].reshape(-1, self.run)
        if self.cut:
            a[self.full * self.run:] = values[whole:]


class Int8Codec(_Lossy):
    """8-bit integers with one float32 scale per chunk of CHUNK values (max |v| / LEVELS):
    about 4x fewer bytes than float32. ``int8:stochastic`` rounds stochastically (unbiased)
    instead of to nearest. Encoding, and the copy update beside it, run in one pass block by
    block. The narrower integers (int4, int2) derive from it."""

    name, compressor = "int8", "Int8Compressor"
    argument = "rounding: nearest (default) or stochastic"
    optional = True
    CHUNK = 1024  # BLOCK is a multiple of it
    LEVELS = 127  # codes run from -LEVELS to LEVELS

    def __init__(self, rounding: str = "nearest"):
        super().__init__()
        if rounding not in ("nearest", "stochastic"):
            raise OptionError(f"{self.name} rounds to 'nearest' or 'stochastic', got "
                              f"{rounding!r}")
        self.rounding = rounding
        self._rng = np.random.default_rng(0) if rounding == "stochastic" else None

    @property
    def spec(self) -> str:
        return self.name if self.rounding == "nearest" else f"{self.name}:{self.rounding}"

    def _chunks(self, n: int) -> int:
        return -(-n // self.CHUNK)

    def _code_bytes(self, n: int) -> int:
        return n

    def nbytes(self, n: int) -> int:
        return self._code_bytes(n) + 4 * self._chunks(n)

    def _layout(self, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        chunks = self._chunks(n)
        return data[:4 * chunks].view(np.float32), data[4 * chunks:4 * chunks + n].view(np.int8)

    def _store(self, rounded: np.ndarray, codes: np.ndarray, start: int, stop: int) -> None:
        """Write a block's rounded values (floats in [-LEVELS, LEVELS]) as its codes."""
        codes[start:stop] = rounded

    def _rows(self, values: np.ndarray) -> list[tuple[slice, np.ndarray]]:
        """(chunk indices, values as rows of a chunk) for the full chunks and the tail, of a
        block that starts on a chunk boundary."""
        n = len(values)
        full = n // self.CHUNK
        parts = [(slice(0, full), values[:full * self.CHUNK].reshape(full, self.CHUNK))]
        if full * self.CHUNK < n:
            parts.append((slice(full, full + 1), values[full * self.CHUNK:].reshape(1, -1)))
        return [part for part in parts if part[1].size]

    def encode_delta(self, values, reference, out, copy=None, seed=0) -> None:
        scales, codes = self._layout(out, len(values))
        difference, work = self.work(np.float32, 0), self.work(np.float32, 1)
        for start, stop in blocks(len(values)):
            d, w = difference[:stop - start], work[:stop - start]
            if reference is None:
                d[...] = values[start:stop]
            else:
                np.subtract(values[start:stop], reference[start:stop], out=d, casting="unsafe")
            first = start // self.CHUNK
            for (index, rows), (_, scratch) in zip(self._rows(d), self._rows(w)):
                np.abs(rows, out=scratch)
                top = scratch.max(axis=1) / self.LEVELS
                scales[first + index.start:first + index.stop] = top
                np.multiply(rows, (1 / np.where(top > 0, top, 1)).astype(np.float32)[:, None],
                            out=scratch)
                if self._rng is not None:
                    noise = self.work(np.float32, 2)[:scratch.size].reshape(scratch.shape)
                    scratch += self._rng.random(dtype=np.float32, out=noise)
                    np.floor(scratch, out=scratch)
                    # LEVELS (1 + eps) + U may floor to LEVELS + 1
                    np.clip(scratch, -self.LEVELS, self.LEVELS, out=scratch)
                else:  # |scaled| <= LEVELS (1 + eps) rounds into range
                    np.rint(scratch, out=scratch)
            self._store(w, codes, start, stop)
            if copy is not None:  # the codes as floats times the scale: what add_to adds
                for index, scratch in self._rows(w):
                    scratch *= scales[first + index.start:first + index.stop, None]
                copy[start:stop] += w

    def _add_block(self, scales, codes, start: int, stop: int, target: np.ndarray) -> None:
        """target[start:stop] += the block's decoded values."""
        work = self.work(np.float32, 2)[:stop - start]
        first = start // self.CHUNK
        for (index, rows), (_, into) in zip(self._rows(codes[start:stop]), self._rows(work)):
            np.multiply(rows, scales[first + index.start:first + index.stop, None], out=into)
        target[start:stop] += work

    def add_to(self, data: np.ndarray, n: int, target: np.ndarray) -> None:
        scales, codes = self._layout(data, n)
        for start, stop in blocks(n):
            self._add_block(scales, codes, start, stop, target)

    def finite(self, data: np.ndarray, n: int) -> bool:
        return bool(np.isfinite(self._layout(data, n)[0]).all())


class _PackedInt(Int8Codec):
    """Integers of BITS < 8 bits, 8 / BITS to a byte (the first in the low bits), offset by
    LEVELS so that they are unsigned: -LEVELS..LEVELS with LEVELS = 2^(BITS-1) - 1 (the
    2-bit code 3 is unused). Smaller chunks than int8's keep more of each chunk above
    the coarse rounding step."""

    def _per_byte(self) -> int:
        return 8 // self.BITS

    def _code_bytes(self, n: int) -> int:
        return -(-n // self._per_byte())

    def _layout(self, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        chunks = self._chunks(n)
        return (data[:4 * chunks].view(np.float32),
                data[4 * chunks:4 * chunks + self._code_bytes(n)])

    def _store(self, rounded: np.ndarray, codes: np.ndarray, start: int, stop: int) -> None:
        per, m = self._per_byte(), stop - start
        unsigned = self.work(np.uint8, 0)[:m]
        np.add(rounded[:m], self.LEVELS, out=unsigned, casting="unsafe")
        full = m // per  # blocks start on a byte: BLOCK and CHUNK are multiples of per
        packed = codes[start // per:start // per + self._code_bytes(m)]
        lanes = unsigned[:full * per].reshape(full, per)
        packed[:full] = lanes[:, 0]
        for j in range(1, per):
            packed[:full] |= lanes[:, j] << np.uint8(self.BITS * j)
        if full * per < m:  # the last byte of the shard, partly filled
            tail = unsigned[full * per:].astype(np.uint8)
            packed[full] = np.bitwise_or.reduce(tail << (self.BITS * np.arange(len(tail),
                                                                           dtype=np.uint8)))

    def _add_block(self, scales, codes, start: int, stop: int, target: np.ndarray) -> None:
        per, m = self._per_byte(), stop - start
        packed = codes[start // per:start // per + self._code_bytes(m)]
        work = self.work(np.float32, 2)[:m]
        mask = np.uint8((1 << self.BITS) - 1)
        for j in range(per):
            lane = work[j::per]
            lane[...] = (packed[:len(lane)] >> np.uint8(self.BITS * j)) & mask
        work -= self.LEVELS
        first = start // self.CHUNK
        for index, rows in self._rows(work):
            rows *= scales[first + index.start:first + index.stop, None]
        target[start:stop] += work


class Int4Codec(_PackedInt):
    """4-bit integers (-7..7) with a float32 scale per 256 values: 7.8x fewer bytes."""

    name, compressor = "int4", "Int4Compressor"
    BITS, LEVELS, CHUNK = 4, 7, 256


class Int2Codec(_PackedInt):
    """2-bit integers (-1, 0, 1: ternary) with a float32 scale per 128 values: 14.2x fewer
    bytes. Rounding to nearest drops every value below half its chunk's largest, so error
    feedback carries most of the difference; the consensus step is smaller."""

    name, compressor = "int2", "Int2Compressor"
    BITS, LEVELS, CHUNK = 2, 1, 128
    consensus_step = 0.5


def _difference(values: np.ndarray, reference: Optional[np.ndarray], where) -> np.ndarray:
    """values[where] - reference[where] (values[where] alone without a reference)."""
    return values[where] if reference is None else values[where] - reference[where]


def _largest(index: np.ndarray, values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k entries of largest magnitude among candidates, in their order (ties by order)."""
    magnitude = np.abs(values)
    kth = np.partition(magnitude, len(values) - k)[len(values) - k]
    keep = magnitude > kth
    tied = np.flatnonzero(magnitude == kth)[:k - int(keep.sum())]
    keep[tied] = True
    return index[keep], values[keep]


REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class under its ``name`` (usable as a decorator)."""
    REGISTRY[cls.name] = cls
    return cls


for _cls in (Codec, FP16Codec, BF16Codec, Int8Codec, Int4Codec, Int2Codec, TopKCodec,
             RandomKCodec):
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
