"""A drop-in for ``horovod.tensorflow.keras``: ``import hvd_sgp.tensorflow.keras as hvd``.

``DistributedOptimizer`` trains with SGP inside compiled ``model.fit`` steps; the callbacks
broadcast the initial state, average metrics and schedule the learning rate as Horovod's do,
and ``callbacks.ConsensusCallback`` averages the models exactly where one model is wanted.
The Keras is ``tf.keras``'s: Keras 3, or tf_keras under ``TF_USE_LEGACY_KERAS=1`` (flavour.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from hvd_sgp.common.errors import NotInitializedError, PeerTimeoutError, SgpError, SgpValueError
from hvd_sgp.tensorflow import flavour
from hvd_sgp.tensorflow import mpi_ops as _ops
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.keras import callbacks
from hvd_sgp.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, cross_rank,
                                        cross_size, init, is_initialized, local_rank,
                                        local_size, mpi_built, mpi_enabled,
                                        mpi_threads_supported, rank, shutdown, size)
from hvd_sgp.common import adapter
from hvd_sgp.tensorflow.flavour import keras
from hvd_sgp.tensorflow.optimizer import (DistributedOptimizer, PartialDistributedOptimizer,
                                          convert)
from hvd_sgp.tensorflow.sync_batch_norm import SyncBatchNormalization
from hvd_sgp.version import __version__


def broadcast_global_variables(root_rank: int) -> None:
    """Not available under eager TF2 (as in Horovod): there is no global variable collection."""
    raise SgpValueError("broadcast_global_variables() needs TF1 graph collections; use "
                        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                        "hvd_sgp.tensorflow.broadcast_variables(model.variables, root_rank)")


def allreduce(value, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op=None,
              compression=Compression.none) -> np.ndarray:
    """Exact reduction of a value (numpy result), as horovod.tensorflow.keras.allreduce."""
    return _ops.allreduce(value, average, compression=compression, op=op,
                          prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor).numpy()


def allgather(value, name: Optional[str] = None) -> np.ndarray:
    return _ops.allgather(value).numpy()


def broadcast(value, root_rank: int, name: Optional[str] = None) -> np.ndarray:
    return _ops.broadcast(value, root_rank).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts: bool = False, **sgp):
    """``tf.keras.models.load_model`` with the saved optimizer (and its state) re-wrapped for
    SGP; SGP keywords (topology=, peers=, ...) as in DistributedOptimizer. ``legacy_opts``:
    the model was saved with ``tf.keras.optimizers.legacy.*`` optimizers (tf_keras only)."""
    objects = {"SyncBatchNormalization": SyncBatchNormalization}
    if legacy_opts:
        if not flavour.LEGACY:
            raise SgpValueError("legacy_opts=True needs tf_keras (TF_USE_LEGACY_KERAS=1): "
                                "Keras 3 has no legacy optimizers")
        legacy = keras.optimizers.legacy.Optimizer.__subclasses__()
        objects.update({cls.__name__.lower(): cls for cls in legacy})
        objects.update({cls.__name__: cls for cls in legacy})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        convert(model.optimizer, adapter.settings(Average, compression, sgp))
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "DistributedOptimizer",
    "PartialDistributedOptimizer", "SyncBatchNormalization",
    "broadcast_global_variables", "allreduce", "allgather", "broadcast", "load_model",
    "callbacks", "NotInitializedError", "PeerTimeoutError", "SgpError", "SgpValueError",
    "__version__",
]
