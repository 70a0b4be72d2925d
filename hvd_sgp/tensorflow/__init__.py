"""A drop-in for ``horovod.tensorflow``: ``import hvd_sgp.tensorflow as hvd``.

Collectives are exact (for metrics and state); ``DistributedOptimizer`` (Keras optimizers in a
custom loop, Keras 3 or tf_keras) and ``DistributedGradientTape`` train with SGP;
``SyncBatchNormalization`` normalises with the statistics of the global batch. All work eagerly
and inside ``tf.function`` (not under XLA).
"""
from __future__ import annotations

from typing import Optional

from hvd_sgp.common.errors import NotInitializedError, PeerTimeoutError, SgpError, SgpValueError
from hvd_sgp.tensorflow import optimizer as _optimizer
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.gradient_tape import (DistributedGradientTape,
                                              PartialDistributedGradientTape)
from hvd_sgp.tensorflow.mpi_ops import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.tensorflow.mpi_ops import __all__ as _ops
from hvd_sgp.tensorflow.mpi_ops import Average, global_process_set
from hvd_sgp.tensorflow.sync_batch_norm import SyncBatchNormalization
from hvd_sgp.version import __version__


def DistributedOptimizer(optimizer, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=global_process_set,
                         scale_local_gradients: bool = True, **sgp):
    """horovod.tensorflow's signature for a Keras optimizer used with ``apply_gradients`` in a
    custom loop; SGP keywords (topology=, peers=, mode=, ...) as in the Keras wrapper."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise SgpValueError("gradient_predivide_factor not supported with op != Average")
    return _optimizer.DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        num_groups, groups, process_set, scale_local_gradients, **sgp)


__all__ = list(_ops) + [
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "NotInitializedError",
    "PeerTimeoutError", "SgpError", "SgpValueError", "__version__",
]
