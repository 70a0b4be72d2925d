"""A PyTorch Lightning strategy that trains with SGP (or exact AllReduce) over MPI.

    trainer = lightning.Trainer(strategy=SGPStrategy(topology="exponential", overlap=False))

launched like any hvd_sgp job (``sgprun -np 4 python train.py`` or ``mpirun``): one process
per rank, no launcher of Lightning's. Every keyword of ``hvd.DistributedOptimizer``'s SGP
options is accepted (``mode="allreduce"`` for the exact baseline). Lightning 2 dropped its
Horovod strategy; this one takes its place with Horovod's recipe inside:

- the optimizers from ``configure_optimizers`` are wrapped in ``hvd_sgp.torch``'s
  DistributedOptimizer after rank 0's parameters and optimizer state are broadcast;
- ``self.log(..., sync_dist=True)`` reduces over all ranks exactly; samplers are distributed;
- a checkpoint (``ModelCheckpoint``, ``trainer.save_checkpoint``) first replaces every rank's
  model by the exact network average, so the file rank 0 writes is the network's model with
  a PushSum weight of 1 and the iteration every rank shares: resuming from it
  (``trainer.fit(..., ckpt_path=...)``) gives every rank one consistent state (rank 0's
  optimizer state, as Horovod's broadcast after a reload does);
- every ``metrics_every`` optimizer steps (the Trainer's ``log_every_n_steps`` by default) the
  SGP figures of every rank (names from hvd_sgp.common.telemetry) go to the Trainer's loggers;
- at the end of ``fit`` the ranks' models are averaged exactly, so every rank holds one model.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import hvd_sgp.torch as hvd
from hvd_sgp.common import options as sgp_options
from hvd_sgp.common.errors import SgpValueError

__all__ = ["SGPStrategy", "MPIRanks"]

_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
               "min": hvd.Min}


class MPIRanks(ClusterEnvironment):
    """The ranks as hvd_sgp's runtime sees them; processes come from sgprun or mpirun."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # unused: no torch.distributed process group is formed

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != hvd.size():
            raise SgpValueError(f"Lightning asked for {size} processes, but the launcher "
                                f"started {hvd.size()} (rank {hvd.rank()})")

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != hvd.rank():
            raise SgpValueError(f"Lightning set global rank {rank} on rank {hvd.rank()}")

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


def _reduce_op(reduce_op: Any) -> Any:
    """Lightning's reduce_op (a string or torch.distributed.ReduceOp) as Horovod's op."""
    name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
    name = name.rsplit(".", 1)[-1]
    if name not in _REDUCE_OPS:
        raise SgpValueError(f"SGPStrategy.reduce: unsupported reduce_op {reduce_op!r} on rank "
                            f"{hvd.rank()}; use one of {sorted(_REDUCE_OPS)}")
    return _REDUCE_OPS[name]


class SGPStrategy(ParallelStrategy):
    """Lightning's Trainer over hvd_sgp: SGP gossip (or ``mode="allreduce"``) on MPI ranks."""

    strategy_name = "hvd_sgp"

    def __init__(self, metrics_every: Optional[int] = None, consensus: bool = True,
                 accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, **sgp: Any):
        """``sgp``: DistributedOptimizer's SGP keywords (topology, peers, overlap, max_delay,
        mode, schedule, ...). ``metrics_every``: optimizer steps between SGP figures sent to
        the loggers (None: the Trainer's log_every_n_steps; 0: never); ``consensus`` adds the
        deviation and consensus distance (one allreduce each time)."""
        sgp_options.resolve(**sgp)  # unknown or bad keywords fail here, not at fit
        if metrics_every is not None and metrics_every < 0:
            raise SgpValueError(f"metrics_every must be >= 0, got {metrics_every}")
        hvd.init()
        super().__init__(accelerator=accelerator, cluster_environment=MPIRanks(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        rank_zero_only.rank = utils_rank_zero_only.rank = hvd.rank()
        self.sgp = sgp
        self.metrics_every = metrics_every
        self.consensus = consensus
        self._steps = 0

    # --- where this rank runs --------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", hvd.local_rank())
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- the optimizers: Horovod's recipe --------------------------------------------------
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        module = self.lightning_module
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        names = {p: n for n, p in module.named_parameters()}
        wrapped = []
        for optimizer in self.optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            wrapped.append(hvd.DistributedOptimizer(
                optimizer, named_parameters=[(names[p], p) for p in params],
                backward_passes_per_step=trainer.accumulate_grad_batches, **self.sgp))
        self.optimizers = wrapped

    def _distributed(self) -> list:
        return [o for o in self.optimizers if hasattr(o, "gathered_sgp_scalars")]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """Lightning runs forward and backward inside the closure; the gradients are averaged
        right after it, before Lightning's hooks and gradient clipping see them (Horovod's
        synchronize-then-clip order)."""
        distributed = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) \
            else optimizer

        def closure_then_average() -> Any:
            result = closure()
            distributed.synchronize()
            return result

        with distributed.skip_synchronize():
            result = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        self._steps += 1
        self._log_figures(distributed)
        return result

    def _log_figures(self, optimizer: Any) -> None:
        trainer = self.lightning_module.trainer
        every = trainer.log_every_n_steps if self.metrics_every is None else self.metrics_every
        if not every or self._steps % every:
            return
        figures = optimizer.gathered_sgp_scalars(self.consensus)  # every rank
        if self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=trainer.global_step)

    def _average(self) -> None:
        """Every rank: the exact network average, BatchNorm statistics included."""
        for optimizer in self._distributed():
            optimizer.average_parameters(self.lightning_module)

    def lightning_module_state_dict(self) -> dict:
        self._average()  # the checkpoint holds the network's model, PushSum weight 1
        return super().lightning_module_state_dict()

    def on_train_end(self) -> None:
        self._average()
        super().on_train_end()

    # --- collectives for Lightning ------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return hvd.allreduce(tensor, op=_reduce_op(reduce_op), name=None)

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        gathered = hvd.allgather(tensor.unsqueeze(0).contiguous())
        return gathered if sync_grads else gathered.detach()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        hvd.barrier()

    def teardown(self) -> None:
        for optimizer in self._distributed():
            optimizer.synchronize_gossip()
        super().teardown()
