"""``hvd.SyncBatchNorm``: batch normalization whose batch statistics cover every rank of a
process set, as Horovod's (and torch.nn.SyncBatchNorm's), on CPU and GPU tensors.

Forward: each rank's per-channel count, mean and sum of squared deviations travel in one
allgather and combine exactly (Chan's parallel formula, no E[x^2] - E[x]^2 cancellation);
ranks may hold different batch sizes. Backward: the per-channel sums of dy and dy * x_hat
travel in one Sum-allreduce, so each rank gets the gradient of the sum of all ranks' losses
with respect to its own inputs; weight and bias get this rank's share (sum them across ranks
for the full-batch gradient, as an optimizer's allreduce does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_sgp.torch.mpi_ops import ProcessSet, Sum, allgather, allreduce, global_process_set


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.SyncBatchNorm / horovod.torch.SyncBatchNorm over ``process_set``.

    Arguments as torch's BatchNorm: ``num_features`` (C of an (N, C, ...) input), ``eps``,
    ``momentum`` (None: cumulative average), ``affine``, ``track_running_stats``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        track = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if track else None,
                                    self.running_var if track else None,
                                    self.eps, factor, self.process_set)


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast against x (N, C, ...)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        xw = x.to(work)
        dims = [0] + list(range(2, x.dim()))
        count = xw.numel() // xw.shape[1]
        mean = xw.mean(dims)
        m2 = ((xw - _per_channel(mean, xw)) ** 2).sum(dims)
        row = torch.cat([torch.tensor([float(count)], dtype=work, device=x.device), mean, m2])
        rows = allgather(row.unsqueeze(0), process_set=process_set)
        c = x.shape[1]
        counts, means, m2s = rows[:, :1], rows[:, 1:c + 1], rows[:, c + 1:]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = m2 / (total - 1).clamp(min=1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        xhat = (xw - _per_channel(mean, xw)) * _per_channel(invstd, xw)
        out = xhat if weight is None else (xhat * _per_channel(weight.to(work), xw)
                                           + _per_channel(bias.to(work), xw))
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.process_set = total, process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        dy = grad_output.to(xhat.dtype)
        dims = [0] + list(range(2, dy.dim()))
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                             process_set=ctx.process_set)
            c = sum_dy.shape[0]
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = _per_channel(scale, dy) * (
                dy - _per_channel(both[:c] / ctx.total, dy)
                - xhat * _per_channel(both[c:] / ctx.total, dy))
            grad_input = grad_input.to(grad_output.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
