"""Horovod's ``Compression`` namespace, generated per framework from the codec registry.

A compressor serves two uses. For exact collectives it is Horovod's interface: ``compress``
returns the tensor for the wire and a context, ``decompress`` undoes it (the cast codecs cast
floating tensors to 16 bits; the others leave collectives exact). For SGP gossip its ``wire``
names the core codec that encodes the pushed parameters (the PushSum weight stays exact).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from hvd_sgp.common.codecs import REGISTRY


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
