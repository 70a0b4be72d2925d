"""The framework-free core: MPI runtime, topologies, PushSum mixing and transport (numpy + mpi4py).

Importing it does not load ``mpi4py.MPI``: the names below are looked up on first use. Nor do
the options, topologies, codecs, telemetry and the mixers (pushsum, choco, sparse, overlap,
mixers), so launchers, the simulator and the options table stay MPI-free.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "NotInitializedError": "errors", "PeerTimeoutError": "errors", "SgpError": "errors",
    "SgpValueError": "errors", "PushSumMixer": "pushsum", "allocate": "pushsum",
    "gossip_average": "gossip", "average_in_node": "node", "cross_rank": "runtime",
    "cross_size": "runtime", "init": "runtime", "is_initialized": "runtime",
    "local_rank": "runtime", "local_size": "runtime", "mpi_threads_supported": "runtime",
    "rank": "runtime", "shutdown": "runtime", "size": "runtime", "Topology": "topology",
    "make_topology": "topology",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
