"""Consensus measures across nodes: how far each rank's parameters are from the network mean."""
from __future__ import annotations

import numpy as np
from hvd_sgp.common.mpi import MPI


def consensus(params: np.ndarray, comm: MPI.Comm) -> dict:
    """One allreduce: this rank's deviation ||z_i - mean||, and the network's mean and max.

    ``distance`` is the consensus distance sqrt(mean_i ||z_i - mean||^2).
    """
    values = np.asarray(params, dtype=np.float64).ravel()
    mean = np.empty_like(values)
    comm.Allreduce(values, mean, op=MPI.SUM)
    mean /= comm.Get_size()
    deviation = float(np.linalg.norm(values - mean))
    squares = comm.allreduce(deviation**2, op=MPI.SUM)
    worst = comm.allreduce(deviation, op=MPI.MAX)
    norm = float(np.linalg.norm(mean))
    return {
        "deviation": deviation,
        "relative_deviation": deviation / norm if norm > 0 else deviation,
        "distance": float(np.sqrt(squares / comm.Get_size())),
        "max_deviation": worst,
        "mean_norm": norm,
    }
