"""A drop-in for ``horovod.tensorflow.keras``: ``import hvd_sgp.tensorflow.keras as hvd``.

``DistributedOptimizer`` trains with SGP inside compiled ``model.fit`` steps; the callbacks
broadcast the initial state, average metrics and schedule the learning rate as Horovod's do,
and ``callbacks.ConsensusCallback`` averages the models exactly where one model is wanted.
The Keras is ``tf.keras``'s: Keras 3, or tf_keras under ``TF_USE_LEGACY_KERAS=1`` (flavour.py).
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from hvd_sgp.common.errors import (HorovodInternalError, HostsUpdatedInterrupt,
                                   NotInitializedError, PeerLostError, PeerTimeoutError,
                                   SgpError, SgpValueError)
from hvd_sgp.tensorflow import flavour
from hvd_sgp.tensorflow import mpi_ops as _ops
from hvd_sgp.tensorflow import compression as compression_module
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.keras import callbacks, elastic
from hvd_sgp.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                        add_process_set, ccl_built, cross_rank, cross_size,
                                        cuda_built, ddl_built, global_process_set, gloo_built,
                                        gloo_enabled, init, is_initialized, local_rank,
                                        local_size, mpi_built, mpi_enabled,
                                        mpi_threads_supported, nccl_built, rank,
                                        remove_process_set, rocm_built, shutdown, size,
                                        start_timeline, stop_timeline)
from hvd_sgp.common import adapter
from hvd_sgp.tensorflow.flavour import keras
from hvd_sgp.tensorflow.outer import with_keras_outer
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
              compression=Compression.none) -> tf.Tensor:
    """Exact reduction of a value across ranks, as a tf tensor (horovod.tensorflow.keras's)."""
    return _ops.allreduce(tf.constant(value), average, compression=compression, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          name=name)


def allgather(value, name: Optional[str] = None) -> tf.Tensor:
    """Every rank's value concatenated along the first dimension, as a tf tensor."""
    return _ops.allgather(tf.constant(value), name=name)


def broadcast(value, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Root's value on every rank, as a tf tensor."""
    return _ops.broadcast(tf.constant(value), root_rank, name=name)


def reducescatter(value, name: Optional[str] = None, op=Average) -> tf.Tensor:
    """Reduction of a value whose rows are scattered over the ranks, as a tf tensor."""
    return _ops.reducescatter(tf.constant(value), op=op, name=name)


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
        settings = adapter.settings(Average, compression, with_keras_outer(sgp),
                                    tensors=compression_module.TENSORS)
        convert(model.optimizer, settings)
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "start_timeline", "stop_timeline", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "SyncBatchNormalization", "broadcast_global_variables", "allreduce", "allgather",
    "broadcast", "reducescatter", "load_model", "callbacks", "elastic", "HorovodInternalError",
    "HostsUpdatedInterrupt", "NotInitializedError", "PeerLostError", "PeerTimeoutError",
    "SgpError", "SgpValueError", "__version__",
]
