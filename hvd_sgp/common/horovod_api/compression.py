"""Horovod's ``Compression`` namespace, generated per framework from the codec registry.

A compressor serves two uses. For exact collectives it is Horovod's interface: ``compress``
returns the tensor for the wire and a context, ``decompress`` undoes it (the cast codecs cast
floating tensors to 16 bits; the others leave collectives exact). For SGP gossip its ``wire``
names the core codec that encodes the pushed parameters (the PushSum weight stays exact).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from hvd_sgp.common.codecs import REGISTRY, Codec, codec
from hvd_sgp.common.errors import OptionError, SgpValueError

# (numpy array -> framework tensor, framework tensor -> numpy array), per framework
Tensors = tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]


class Compressor:
    """Horovod's compressor interface for framework tensors."""

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


class _Variants(type):
    """The metaclass of a compressor whose codec takes an optional argument: the class is the
    default (``Compression.int8``), and calling it names a variant
    (``Compression.int8("stochastic")``). Horovod never instantiates compressors."""

    def __call__(cls, value):
        return cls.variant(value)


def namespace(doc: str, cast: Callable[[Any, Any], Any], is_floating: Callable[[Any], bool],
              dtypes: Mapping[str, Any]) -> tuple[type, dict[str, type]]:
    """The ``Compression`` class for one framework (``cast``/``is_floating`` on its tensors,
    ``dtypes`` its dtype per numpy dtype name) and the compressor classes by class name.

    Each registered codec becomes an attribute: a compressor class, or for a codec that takes
    an argument (``topk:F``) a function of it returning one; where the argument is optional
    (``int8``) the class itself, callable with the argument.
    """
    framework_cast = type("FrameworkCast", (CastCompressor,),
                          {"cast": staticmethod(cast), "is_floating": staticmethod(is_floating)})

    def compressor(codec_cls, spec: str) -> type:
        if codec_cls.cast:
            return type(codec_cls.compressor, (framework_cast,),
                        {"wire": spec, "dtype": dtypes[codec_cls.cast]})
        return type(codec_cls.compressor, (Compressor,), {"wire": spec})

    attributes: dict[str, Any] = {"__doc__": doc}
    classes: dict[str, type] = {}
    for name, codec_cls in REGISTRY.items():
        if codec_cls.optional:
            variant = staticmethod(lambda value, c=codec_cls, n=name: compressor(c, f"{n}:{value}"))
            classes[codec_cls.compressor] = attributes[name] = _Variants(
                codec_cls.compressor, (Compressor,), {"wire": name, "variant": variant})
        elif codec_cls.argument:
            attributes[name] = staticmethod(
                lambda value, c=codec_cls, n=name: compressor(c, f"{n}:{value}"))
        else:
            classes[codec_cls.compressor] = attributes[name] = compressor(codec_cls, name)
    return type("Compression", (), attributes), classes


class CompressorCodec(Codec):
    """A script's own Horovod Compressor (``compress``/``decompress`` on framework tensors) as
    the gossip codec: the compressed tensor's bytes travel, and the receiver decompresses them
    with the context of its own compress of a tensor like the sender's, as in Horovod's
    allreduce, where each rank decompresses the sum with its own context. So the context may
    depend on the dtype and shape, not on the values (true of casts)."""

    exact = False

    def __init__(self, compressor: Any, tensors: Tensors):
        super().__init__()
        self.compressor, (self.to_tensor, self.to_numpy) = compressor, tensors
        self._layouts: dict[int, tuple[np.dtype, tuple, Any]] = {}

    @property
    def spec(self) -> str:
        return f"custom:{getattr(self.compressor, '__qualname__', type(self.compressor).__name__)}"

    def _layout(self, n: int) -> tuple[np.dtype, tuple, Any]:
        """Wire dtype, wire shape and context of n float32 values, from a compress of zeros."""
        if n not in self._layouts:
            wire, ctx = self.compressor.compress(self.to_tensor(np.zeros(n, np.float32)))
            array = self.to_numpy(wire)
            self._layouts[n] = array.dtype, array.shape, ctx
        return self._layouts[n]

    def nbytes(self, n: int) -> int:
        dtype, shape, _ = self._layout(n)
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        wire, _ = self.compressor.compress(self.to_tensor(np.asarray(values, np.float32)))
        out[...] = np.ascontiguousarray(self.to_numpy(wire)).reshape(-1).view(np.uint8)

    def decode(self, data: np.ndarray, n: int) -> np.ndarray:
        dtype, shape, ctx = self._layout(n)
        wire = self.to_tensor(np.ascontiguousarray(data).view(dtype).reshape(shape))
        return self.to_numpy(self.compressor.decompress(wire, ctx)).reshape(-1)


def gossip_codec(compression: Any, tensors: Optional[Tensors]) -> Codec:
    """The codec of a ``compression=`` choice: a generated compressor names one (``wire``);
    any other object with Horovod's ``compress``/``decompress`` is wrapped. Where the script
    asks for none (``Compression.none``, or nothing), ``HVD_SGP_COMPRESSION`` may name one."""
    wire = getattr(compression, "wire", None)
    if wire == "none":
        return _environment_codec()
    if wire is not None:
        return codec(wire)
    if tensors is None or not all(callable(getattr(compression, f, None))
                                  for f in ("compress", "decompress")):
        raise SgpValueError(f"compression must be one of hvd.Compression's choices or a "
                            f"Horovod Compressor (compress/decompress), got {compression!r}")
    return CompressorCodec(compression, tensors)


def _environment_codec() -> Codec:
    """``HVD_SGP_COMPRESSION`` (default none), its errors naming the variable."""
    from hvd_sgp.common import options

    spec = options.from_environment("compression")
    try:
        return codec(spec)
    except OptionError as error:
        raise OptionError(f"{options.BY_NAME['compression'].env}={spec!r}: "
                          f"{str(error).split(': ', 1)[-1]}") from None
