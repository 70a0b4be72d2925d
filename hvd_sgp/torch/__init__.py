"""A drop-in for ``horovod.torch``: ``import hvd_sgp.torch as hvd``.

Collectives are exact (for metrics and state); ``DistributedOptimizer`` trains with SGP.
"""
import importlib

from hvd_sgp.common import spares as _spares
from hvd_sgp.common.errors import (HorovodInternalError, HostsUpdatedInterrupt,
                                   NotInitializedError, PeerLostError, PeerTimeoutError,
                                   SgpError, SgpValueError)
from hvd_sgp.torch import elastic
from hvd_sgp.torch.compression import Compression
from hvd_sgp.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvd_sgp.torch.mpi_ops import *  # noqa: F401,F403  (Horovod's flat namespace)
from hvd_sgp.torch.mpi_ops import __all__ as _ops
from hvd_sgp.torch.optimizer import DistributedOptimizer
from hvd_sgp.torch.sync_batch_norm import SyncBatchNorm
from hvd_sgp.version import __version__

# A warm spare (hvd_sgp/common/spares.py) imports ahead what torch's first optimizer imports
# (torch._dynamo, about 1 s of CPU here), so a replacement is training sooner.
_spares.while_waiting(lambda: importlib.import_module("torch._dynamo"))

__all__ = list(_ops) + [
    "Compression", "DistributedOptimizer", "allgather_object", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "SyncBatchNorm", "elastic",
    "HorovodInternalError", "HostsUpdatedInterrupt", "NotInitializedError", "PeerLostError",
    "PeerTimeoutError", "SgpError", "SgpValueError", "__version__",
]
