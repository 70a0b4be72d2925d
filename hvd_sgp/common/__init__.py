"""The framework-free core: MPI runtime, topologies, PushSum mixing and transport (numpy + mpi4py)."""
from hvd_sgp.common.errors import (NotInitializedError, PeerTimeoutError, SgpError,
                                   SgpValueError)
from hvd_sgp.common.pushsum import PushSumMixer, allocate, average_in_node, gossip_average
from hvd_sgp.common.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                                    local_size, mpi_threads_supported, rank, shutdown, size)
from hvd_sgp.common.topology import Topology, make_topology

__all__ = [
    "NotInitializedError", "PeerTimeoutError", "SgpError", "SgpValueError", "PushSumMixer",
    "allocate", "average_in_node", "gossip_average", "cross_rank", "cross_size", "init",
    "is_initialized", "local_rank", "local_size", "mpi_threads_supported", "rank", "shutdown",
    "size", "Topology", "make_topology",
]
