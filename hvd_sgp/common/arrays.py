"""The few array operations the mixer needs beyond slicing and in-place arithmetic.

The core mixes numpy arrays on the host. An adapter can hand it its own tensors instead (torch
CUDA tensors given straight to a CUDA-aware MPI, see hvd_sgp/torch/tensor_kit.py) by
registering a kit for their type (``register``, called by the adapter when it first builds a
buffer); mpi4py takes such tensors through DLPack. The core never imports a framework: it only
looks the kit up by the buffer's type (and uses a kernel an adapter lent it, see native_lerp).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from hvd_sgp.common import codecs
from hvd_sgp.common.codecs import Codec
from hvd_sgp.common.errors import SgpValueError

WIRE = np.dtype(np.uint8)  # encoded messages are bytes (codecs.py)


class ArrayKit:
    """Array creation, dtypes, host copies and the wire codecs for one array type."""

    def is_flat(self, a: Any) -> bool:
        """One contiguous 1-D array (what a PushSum buffer must be)."""
        raise NotImplementedError

    def numpy_dtype(self, a: Any) -> np.dtype:
        raise NotImplementedError

    def empty(self, like: Any, shape: tuple, wire: bool = False) -> Any:
        """Uninitialised storage beside ``like`` (its dtype, or bytes for the wire)."""
        raise NotImplementedError

    def ones(self, like: Any, size: int) -> Any:
        raise NotImplementedError

    def concat(self, parts: Sequence[Any]) -> Any:
        raise NotImplementedError

    def total(self, a: Any) -> float:
        """The float64 sum (audits)."""
        raise NotImplementedError

    def finite(self, a: Any) -> bool:
        """No NaN or infinity in ``a`` (the check on every received message)."""
        return math.isfinite(self.total(a))

    def to_numpy(self, a: Any) -> np.ndarray:
        """A host float64 copy (telemetry)."""
        raise NotImplementedError

    def lerp(self, a: Any, b: Any, t: float) -> None:
        """a += t (b - a) in place, in one pass over memory (how PushSum sums in a message)."""
        raise NotImplementedError

    def ready(self, a: Any) -> None:
        """Make pending writes to ``a`` visible to MPI (device kits wait for their stream)."""

    @contextlib.contextmanager
    def for_mpi(self, a: Any) -> Iterator[Any]:
        """``a`` as MPI may read and write it in place (a host copy written back at exit
        where MPI cannot reach its memory)."""
        self.ready(a)
        yield a

    def pack(self, codec: Codec, values: Any, weight: float, out: Any) -> None:
        raise NotImplementedError

    def unpack(self, codec: Codec, message: Any, n: int) -> tuple[Any, float]:
        raise NotImplementedError


class NumpyKit(ArrayKit):
    def is_flat(self, a: np.ndarray) -> bool:
        return a.ndim == 1 and a.flags.c_contiguous

    def numpy_dtype(self, a: np.ndarray) -> np.dtype:
        return a.dtype

    def empty(self, like: np.ndarray, shape: tuple, wire: bool = False) -> np.ndarray:
        return np.empty(shape, WIRE if wire else like.dtype)

    def ones(self, like: np.ndarray, size: int) -> np.ndarray:
        return np.ones(size, like.dtype)

    def concat(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    def total(self, a: np.ndarray) -> float:
        return float(a.sum(dtype=np.float64))

    def finite(self, a: np.ndarray) -> bool:
        """One BLAS dot product (a read-only pass at memory speed, 2.4x cheaper than the
        float64 sum); the exact elementwise test only when that is not finite (a NaN or
        infinity, or squares that overflow)."""
        if a.dtype in (np.float32, np.float64):
            with np.errstate(over="ignore", invalid="ignore"):
                if math.isfinite(float(np.dot(a, a))):
                    return True
        return bool(np.isfinite(a).all())

    def to_numpy(self, a: np.ndarray) -> np.ndarray:
        return a.astype(np.float64)

    LERP_BLOCK = 1 << 14  # values per block: the block's temporary stays in the L1/L2 cache
    # A fused lerp of two contiguous arrays (b cast to a's dtype), where a framework has one (the torch
    # adapter registers torch's, which runs at the speed of an add; numpy's blocks cost ~1.6x)
    native_lerp: Optional[Callable[[np.ndarray, np.ndarray, float], None]] = None

    def lerp(self, a: np.ndarray, b: np.ndarray, t: float) -> None:
        """numpy has no fused lerp: without a native one it runs block by block, so the
        three operations of a block stay in cache and memory sees about one pass."""
        if t == 1.0:
            a[...] = b
            return
        if (self.native_lerp is not None and a.flags.c_contiguous and b.flags.c_contiguous
                and a.flags.writeable and b.flags.writeable):
            self.native_lerp(a, b, t)
            return
        step = self.LERP_BLOCK
        scratch = np.empty(min(step, len(a)), np.result_type(a, b))
        for start in range(0, len(a), step):
            block, part = a[start:start + step], scratch[:min(step, len(a) - start)]
            np.subtract(b[start:start + step], block, out=part)
            part *= t
            block += part

    @contextlib.contextmanager
    def for_mpi(self, a: np.ndarray) -> Iterator[np.ndarray]:
        if a.flags.c_contiguous:
            yield a
            return
        copy = np.ascontiguousarray(a)
        yield copy
        a[...] = copy

    def pack(self, codec: Codec, values: np.ndarray, weight: float, out: np.ndarray) -> None:
        codecs.pack(codec, values, weight, out)

    def unpack(self, codec: Codec, message: np.ndarray, n: int) -> tuple[np.ndarray, float]:
        return codecs.unpack(codec, message, n)


NUMPY = NumpyKit()
_KITS: dict[type, ArrayKit] = {np.ndarray: NUMPY}


def register(kind: type, kit: ArrayKit) -> None:
    """Let the core mix arrays of type ``kind`` (idempotent)."""
    _KITS.setdefault(kind, kit)


def kit_for(a: Any) -> ArrayKit:
    for kind in type(a).__mro__:
        if kind in _KITS:
            return _KITS[kind]
    raise TypeError(f"hvd_sgp cannot mix buffers of type {type(a).__name__}; use a numpy "
                    "array or a tensor of a framework whose adapter registered a kit")


def host_view(buffer) -> np.ndarray:
    """The buffer as a numpy array sharing its memory (numpy arrays, CPU tensors through
    ``__array__``): compressed gossip encodes on the host."""
    try:
        view = np.asarray(buffer)
    except (TypeError, RuntimeError, ValueError):
        view = None
    if view is None or view.ndim != 1 or not view.flags.writeable:
        raise SgpValueError("compressed gossip and outer optimizers work in host memory; device "
                            "parameters need the staged placement (HVD_SGP_CUDA_AWARE=0)")
    return view
