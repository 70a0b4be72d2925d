"""Parameters re-homed as views into one flat tensor per (device, dtype), the SGP buffer.

The flat tensor has one extra element, the PushSum weight slot, so parameters and weight
travel as one message. Where the core mixes it depends on the device (``placement``):

- ``view``: CPU tensors; the core mixes the tensor's own memory through a numpy view.
- ``direct``: CUDA tensors with a CUDA-aware MPI; the core mixes the tensor itself on the GPU
  (tensor_kit.py) and MPI reads and writes device memory.
- ``staged``: other device tensors; a (pinned) host copy is mixed. On CUDA the copy out runs
  on a side stream and the host waits only for it; the copy back is queued on the side stream
  and the compute stream waits for it on the GPU, so the host goes on to the next step at once.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

import torch

from hvd_sgp.common import runtime
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.torch import tensor_kit

PLACEMENTS = ("view", "direct", "staged")


def placement(device: torch.device) -> str:
    """Where the core mixes parameters living on ``device`` (see the module docstring)."""
    if device.type == "cpu":
        return "view"
    return "direct" if device.type == "cuda" and runtime.cuda_aware_mpi() else "staged"


class FlatGroup:
    """One (device, dtype) group of parameters living in ``self.flat[:-1]``; ``self.buffer``
    is what the core mixes."""

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
        self.placement = placement(self.device)
        if self.placement not in PLACEMENTS:
            raise SgpValueError(f"unknown placement {self.placement!r}; one of {PLACEMENTS}")
        cuda = self.device.type == "cuda"
        side = cuda and self.placement == "staged"
        self._host: Optional[torch.Tensor] = None
        self._stream = torch.cuda.Stream(self.device) if side else None
        self._copied = torch.cuda.Event() if side else None
        if self.placement == "view":
            self.buffer = self.flat.numpy()
        elif self.placement == "direct":
            self.buffer = self.flat
        else:
            self._host = torch.empty(self.numel + 1, dtype=first.dtype, pin_memory=cuda)
            self.buffer = self._host.numpy()
        self._grad: Optional[torch.Tensor] = None  # only where gradients are reduced
        self._grad_views: list[torch.Tensor] = []  # each parameter's run of it, shaped
        self._view_of: dict[int, torch.Tensor] = {}  # the same, by id of the parameter
        self._replaced: list[torch.Tensor] = []  # see release_replaced()
        self._host_grad: Optional[torch.Tensor] = None

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradients, and one spare element for the engine (see step_protocol.py)."""
        if self._grad is None:
            self._grad = torch.zeros(self.numel + 1, dtype=self.flat.dtype, device=self.device)
            self._grad_views = [self._grad[a:b].view_as(p)
                                for p, (a, b) in zip(self.params, self.slices)]
            self._view_of = {id(p): view for p, view in zip(self.params, self._grad_views)}
        return self._grad

    def gather_grads(self, scale: float = 1.0) -> torch.Tensor:
        """The gradients times ``scale`` as one flat tensor on the group's device (zeros where
        None; sparse gradients, e.g. of an Embedding(sparse=True), densified). The scaling
        rides in the copy: no separate pass over the buffer."""
        self.release_replaced()
        for p, (a, b) in zip(self.params, self.slices):
            view = self.grad[a:b]
            if p.grad is None:
                view.zero_()
                continue
            if not p.grad.is_sparse and p.grad.data_ptr() == view.data_ptr():
                if scale != 1.0:  # backward accumulated into the view (zero_grad kept it)
                    view.mul_(scale)
                continue
            grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1)
            if scale == 1.0:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
        return self.grad

    def scatter_grads(self) -> None:
        """Hand the reduced gradients back as views of the flat gradients (torch DDP's
        ``gradient_as_bucket_view``): no copy back, and zero_grad keeps them (zero_views, or
        set_to_none=False), so backward accumulates into the flat buffer and the next gather
        has nothing to copy either. A sparse gradient stays sparse (rows any rank touched),
        for optimizers that need one (SparseAdam)."""
        for p, reduced in zip(self.params, self._grad_views):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                p.grad = reduced.to_sparse(p.grad.sparse_dim())
            elif p.grad.data_ptr() != reduced.data_ptr():
                self._replaced.append(p.grad)
                p.grad = reduced

    def holding_views(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient is their view of the flat gradients."""
        return [p for p, view in zip(self.params, self._grad_views)
                if p.grad is not None and not p.grad.is_sparse
                and p.grad.data_ptr() == view.data_ptr()]

    def zero_views(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Hand ``params`` their views of the flat gradients again, all zeroed by one memset
        (zero_grad that keeps the views; the other runs are overwritten by the next gather)."""
        if not params:
            return
        self._grad[:self.numel].zero_()
        for p in params:
            p.grad = self._view_of[id(p)]

    def drop_views(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Set to None the gradients of ``params`` that are still their zeroed views: no
        backward reached them since zero_grad, where torch would have left None."""
        for p in params:
            if p.grad is not None and p.grad.data_ptr() == self._view_of[id(p)].data_ptr():
                p.grad = None

    def release_replaced(self) -> None:
        """Free the gradients autograd allocated, which the views replaced. They are held
        until zero_grad(), where they would be freed without the views: freed inside step(),
        glibc's malloc returns their pages to the kernel and the next backward faults them
        all back in (measured: 23,000 faults, +25 ms CPU per step for 25.6M parameters)."""
        self._replaced.clear()

    def grads_for_mpi(self, scale: float = 1.0):
        """The flat gradients times ``scale`` as the core should reduce them (same placement
        as the buffer)."""
        grads = self.gather_grads(scale)
        if self.placement == "view":
            return grads.numpy()
        if self.placement == "direct":
            return grads
        if self._host_grad is None:
            self._host_grad = torch.empty(self.numel + 1, dtype=grads.dtype,
                                          pin_memory=self.device.type == "cuda")
        self._host_grad.copy_(grads)
        return self._host_grad.numpy()

    def grads_from_mpi(self) -> None:
        """Put the reduced gradients (from grads_for_mpi) back into each parameter's grad."""
        if self.placement == "staged":
            self.grad.copy_(self._host_grad)
        self.scatter_grads()

    def copy_out(self) -> None:
        """Start copying the parameters to the staging buffer (``wait_out`` completes it)."""
        if self.placement != "staged":
            return
        if self._stream is None:
            self._host.copy_(self.flat)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._host.copy_(self.flat, non_blocking=True)
            self._copied.record(self._stream)

    def wait_out(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def copy_in(self) -> None:
        """Queue the mixed parameters' copy back; the compute stream waits for it on the GPU.
        The side stream also orders it before the next copy out, so the host buffer is not
        overwritten while it is read."""
        if self.placement != "staged":
            return
        if self._stream is None:
            self.flat.copy_(self._host)
            return
        with torch.cuda.stream(self._stream):
            self.flat.copy_(self._host, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def check_views(self) -> None:
        """Fail loudly if something (model.to(), load_state_dict(assign=True)) re-homed a
        parameter after wrapping: it would silently stop being gossiped."""
        for p, (a, b) in zip(self.params, self.slices):
            if p.data.data_ptr() != self.flat[a:b].data_ptr():
                raise SgpValueError("a parameter was moved out of hvd_sgp's buffer after "
                                    "DistributedOptimizer was created (model.to()/.cuda() must "
                                    "come before wrapping the optimizer)")


@contextlib.contextmanager
def staged(groups: Sequence[FlatGroup]) -> Iterator[None]:
    """Around every use of the core's buffers: staged groups copy out before (all copies in
    flight together) and back after; the other placements need nothing."""
    for group in groups:
        group.copy_out()
    for group in groups:
        group.wait_out()
    yield
    for group in groups:
        group.copy_in()


def group_parameters(params: list[torch.nn.Parameter]) -> list[FlatGroup]:
    """One FlatGroup per (device, dtype), in first-appearance order (same on every rank)."""
    tensor_kit.register()
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    for p in params:
        groups.setdefault((str(p.device), p.dtype), []).append(p)
    return [FlatGroup(ps) for ps in groups.values()]
