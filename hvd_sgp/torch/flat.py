"""Parameters re-homed as views into one flat tensor per (device, dtype), the SGP buffer.

The flat tensor has one extra element, the PushSum weight slot, so parameters and weight
travel as one message. On CPU the core mixes the tensor's own memory (a numpy view, no copy);
CUDA buffers are staged through pinned host memory around each exchange.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from hvd_sgp.common.errors import SgpValueError


class FlatGroup:
    """One (device, dtype) group of parameters living in ``self.flat[:-1]``."""

    def __init__(self, params: list[torch.nn.Parameter]):
        first = params[0]
        if first.dtype == torch.bfloat16:
            raise SgpValueError("bfloat16 parameters cannot be gossiped exactly; keep float32 "
                                "master parameters (autocast) and use compression=bf16")
        self.params = params
        self.device = first.device
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel + 1, dtype=first.dtype, device=self.device)
        self.flat[self.numel] = 1
        self.slices = []
        offset = 0
        with torch.no_grad():
            for p in params:
                view = self.flat[offset:offset + p.numel()]
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)
                self.slices.append((offset, offset + p.numel()))
                offset += p.numel()
        if self.device.type == "cpu":
            self._host: Optional[torch.Tensor] = None
            self.host = self.flat.numpy()
        else:
            self._host = torch.empty(self.numel + 1, dtype=first.dtype, pin_memory=True)
            self.host = self._host.numpy()
        self._grad: Optional[torch.Tensor] = None  # only where gradients are reduced

    @property
    def grad(self) -> torch.Tensor:
        if self._grad is None:
            self._grad = torch.zeros(self.numel, dtype=self.flat.dtype, device=self.device)
        return self._grad

    def gather_grads(self) -> torch.Tensor:
        """The gradients as one flat tensor on the group's device (zeros where None)."""
        for p, (a, b) in zip(self.params, self.slices):
            if p.grad is None:
                self.grad[a:b].zero_()
            else:
                self.grad[a:b].copy_(p.grad.reshape(-1))
        return self.grad

    def scatter_grads(self) -> None:
        for p, (a, b) in zip(self.params, self.slices):
            if p.grad is not None:
                p.grad.copy_(self.grad[a:b].view_as(p.grad))

    def grads_on_host(self) -> np.ndarray:
        grads = self.gather_grads()
        return grads.numpy() if self._host is None else grads.cpu().numpy()

    def grads_from_host(self, host: np.ndarray) -> None:
        if self._host is not None:
            self.grad.copy_(torch.from_numpy(host))
        self.scatter_grads()

    def to_host(self) -> None:
        if self._host is not None:
            self._host.copy_(self.flat)

    def from_host(self) -> None:
        if self._host is not None:
            self.flat.copy_(self._host, non_blocking=False)

    def check_views(self) -> None:
        """Fail loudly if something (model.to(), load_state_dict(assign=True)) re-homed a
        parameter after wrapping: it would silently stop being gossiped."""
        for p, (a, b) in zip(self.params, self.slices):
            if p.data.data_ptr() != self.flat[a:b].data_ptr():
                raise SgpValueError("a parameter was moved out of hvd_sgp's buffer after "
                                    "DistributedOptimizer was created (model.to()/.cuda() must "
                                    "come before wrapping the optimizer)")


def group_parameters(params: list[torch.nn.Parameter]) -> list[FlatGroup]:
    """One FlatGroup per (device, dtype), in first-appearance order (same on every rank)."""
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    for p in params:
        groups.setdefault((str(p.device), p.dtype), []).append(p)
    return [FlatGroup(ps) for ps in groups.values()]
