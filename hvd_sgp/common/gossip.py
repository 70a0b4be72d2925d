"""One call that gossip-averages an array over MPI (examples, launch checks): a PushSumMixer
over a PeerTransport on the ranks of a communicator, for a number of steps.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from hvd_sgp.common import place
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.pushsum import PushSumMixer, allocate
from hvd_sgp.common.topology import make_topology
from hvd_sgp.common.transport import PeerTransport


def gossip_average(values: np.ndarray, steps: int, topology="exponential", peers: int = 1,
                   comm: Optional[MPI.Comm] = None, push_sum: bool = True) -> np.ndarray:
    """Gossip-average a numpy array across the ranks of ``comm`` for ``steps`` iterations.

    Every rank passes its own array (same shape and dtype); each gets back its de-biased
    estimate of the average, which is exact after log2(n) steps of the one-peer exponential
    graph when n is a power of two.
    """
    comm = comm if comm is not None else place.world_comm()
    flat = np.asarray(values)
    buffer = allocate(flat.size, flat.dtype if flat.dtype.kind == "f" else np.float64)
    buffer[:-1] = flat.ravel()
    transport = PeerTransport(comm)
    mixer = PushSumMixer(buffer, make_topology(topology, comm.Get_size(), peers), transport,
                         push_sum=push_sum)
    for _ in range(steps):
        mixer.mix()
    transport.free()
    return buffer[:-1].reshape(flat.shape).copy()
