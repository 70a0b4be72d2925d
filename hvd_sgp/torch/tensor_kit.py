"""The core's array kit for torch tensors: PushSum mixing straight on (CUDA) tensors.

With a CUDA-aware MPI the mixer's arithmetic runs on the GPU and mpi4py hands device pointers
to MPI (through DLPack), so no host copy is made. Torch queues kernels asynchronously and MPI
does not know torch's streams, so ``ready`` waits for the current stream before MPI reads.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hvd_sgp.common import arrays
from hvd_sgp.common.compression import WEIGHT_WORDS, Codec
from hvd_sgp.common.mpi import MPI

_TYPECODES = {torch.float16: "e", torch.float32: "f", torch.float64: "d", torch.uint16: "H"}
_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


class TorchKit(arrays.ArrayKit):
    def is_flat(self, a: torch.Tensor) -> bool:
        return a.dim() == 1 and a.is_contiguous()

    def mpi_type(self, a: torch.Tensor) -> MPI.Datatype:
        return MPI._typedict[_TYPECODES[a.dtype]]  # the numpy kit's types, by typecode

    def empty(self, like: torch.Tensor, shape: tuple, wire: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint16 if wire else like.dtype, device=like.device)

    def ones(self, like: torch.Tensor, size: int) -> torch.Tensor:
        return torch.ones(size, dtype=like.dtype, device=like.device)

    def copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def total(self, a: torch.Tensor) -> float:
        return float(a.sum(dtype=torch.float64))

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().to("cpu", torch.float64).numpy()

    def ready(self, a: torch.Tensor) -> None:
        if a.is_cuda:
            torch.cuda.current_stream(a.device).synchronize()

    def pack(self, codec: Codec, values: torch.Tensor, weight: float, out: torch.Tensor) -> None:
        """The same bytes as the numpy codecs (round to nearest even, weight as float64)."""
        out[:-WEIGHT_WORDS].view(_WIRE[codec.name]).copy_(values)
        exact = torch.tensor([weight], dtype=torch.float64, device=out.device)
        out[-WEIGHT_WORDS:].copy_(exact.view(torch.uint16))

    def unpack(self, codec: Codec, message: torch.Tensor) -> tuple[torch.Tensor, float]:
        weight = message[-WEIGHT_WORDS:].clone().view(torch.float64)
        return message[:-WEIGHT_WORDS].view(_WIRE[codec.name]), float(weight[0])


arrays.register(torch.Tensor, TorchKit())
