"""The core's array kit for torch tensors: PushSum mixing straight on (CUDA) tensors.

With a CUDA-aware MPI the mixer's arithmetic runs on the GPU and mpi4py hands device pointers
to MPI (through DLPack), so no host copy is made. Torch queues kernels asynchronously and MPI
does not know torch's streams, so ``ready`` waits for the current stream before MPI reads.
Codecs with a torch encoder here run on the device; others go through host memory.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch

from hvd_sgp.common import arrays, codecs, runtime
from hvd_sgp.common.codecs import BLOCK, WEIGHT_BYTES, BF16Codec, Codec, FP16Codec, blocks

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.uint8: np.uint8}
# codecs whose format is a plain torch cast: the same bytes as the numpy encoders
_CASTS = {FP16Codec: torch.float16, BF16Codec: torch.bfloat16}


class TorchKit(arrays.ArrayKit):
    def is_flat(self, a: torch.Tensor) -> bool:
        return a.dim() == 1 and a.is_contiguous()

    def numpy_dtype(self, a: torch.Tensor) -> np.dtype:
        return np.dtype(_NUMPY[a.dtype])

    def empty(self, like: torch.Tensor, shape: tuple, wire: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8 if wire else like.dtype, device=like.device)

    def ones(self, like: torch.Tensor, size: int) -> torch.Tensor:
        return torch.ones(size, dtype=like.dtype, device=like.device)

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def total(self, a: torch.Tensor) -> float:
        return float(a.sum(dtype=torch.float64))

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().to("cpu", torch.float64).numpy()

    def lerp(self, a: torch.Tensor, b: torch.Tensor, t: float) -> None:
        with torch.no_grad():
            a.lerp_(b.to(a.dtype), t)

    def ready(self, a: torch.Tensor) -> None:
        if a.is_cuda:
            torch.cuda.current_stream(a.device).synchronize()

    @contextlib.contextmanager
    def for_mpi(self, a: torch.Tensor) -> Iterator:
        """CPU tensors as numpy views; CUDA tensors themselves where MPI is CUDA-aware; else a
        host copy (16-bit floats widened), written back at exit."""
        plain = a.is_contiguous() and a.dtype in _NUMPY
        if plain and a.device.type == "cpu":
            yield a.detach().numpy()
        elif plain and a.is_cuda and runtime.cuda_aware_mpi():
            self.ready(a)
            yield a
        else:
            host = a.detach().to("cpu", a.dtype if a.dtype in _NUMPY else torch.float32,
                                 copy=True).contiguous()
            yield host.numpy()
            with torch.no_grad():
                a.copy_(host)

    def pack(self, codec: Codec, values: torch.Tensor, weight: float, out: torch.Tensor) -> None:
        cast = _CASTS.get(type(codec))
        if cast is None:  # no device encoder: encode on the host
            host = np.empty(out.numel(), np.uint8)
            codecs.pack(codec, values.detach().cpu().numpy(), weight, host)
            out.copy_(torch.from_numpy(host))
            return
        out[:-WEIGHT_BYTES].view(cast).copy_(values)
        exact = torch.tensor([weight], dtype=torch.float64, device=out.device)
        out[-WEIGHT_BYTES:].copy_(exact.view(torch.uint8))

    def unpack(self, codec: Codec, message: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
        weight = float(message[-WEIGHT_BYTES:].clone().view(torch.float64)[0])
        cast = _CASTS.get(type(codec))
        if cast is None:
            values, _ = codecs.unpack(codec, message.cpu().numpy(), n)
            return torch.from_numpy(np.array(values)).to(message.device), weight
        return message[:-WEIGHT_BYTES].view(cast), weight


def _lerp_numpy(a: np.ndarray, b: np.ndarray, t: float) -> None:
    """a += t (b - a); a 16-bit b (an fp16 push) is widened block by block into one reused
    buffer: widening it whole allocated a model-sized array per message (measured at 25.6M
    values: 62 ms a message, 18 ms blocked)."""
    target, source = torch.from_numpy(a), torch.from_numpy(b)
    if source.dtype == target.dtype:
        target.lerp_(source, t)
        return
    wide = torch.empty(min(len(a), BLOCK), dtype=target.dtype)
    for start, stop in blocks(len(a)):
        part = wide[:stop - start]
        part.copy_(source[start:stop])
        target[start:stop].lerp_(part, t)


def register() -> None:
    """Let the core mix torch tensors, and lend its numpy kit torch's fused lerp (called when
    the first flat buffer is built)."""
    arrays.register(torch.Tensor, TorchKit())
    arrays.NUMPY.native_lerp = _lerp_numpy
