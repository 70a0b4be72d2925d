"""SGP simulated in one process, for up to thousands of nodes (``python -m hvd_sgp.sim``).

Every node runs the core's own mixer (PushSumMixer, or ChocoMixer or SparseMixer for lossy
codecs, synchronous or with Overlap SGP's timing for delays, as mixers.py chooses) over an
in-process transport, and local steps follow the core's OuterLoop, so consensus, bias, delay
and compression effects can be studied at sizes no test cluster has, with the very code that
runs over MPI. No MPI is started and no framework is imported.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np

from hvd_sgp.common.outer import OuterLoop
from hvd_sgp.common.topology import Topology
from hvd_sgp.sim.network import SimNetwork
from hvd_sgp.sim.objectives import OBJECTIVES, Objective, make_objective

__all__ = ["SimNetwork", "simulate", "OBJECTIVES", "make_objective"]


def simulate(topology: Union[str, Topology] = "exponential", nodes: int = 64, steps: int = 20,
             lr: float = 0.0, objective: str = "quadratic", delay: int = 0, debias: bool = True,
             peers: int = 1, dim: int = 8, seed: int = 0, codec: str = "none",
             error_feedback: bool = True, consensus_step: Optional[float] = None,
             local_steps: int = 1, spread: float = 1.0) -> list[dict]:
    """Run SGP (lr = 0: pure mixing) and return one record per step, step 0 being the start.

    Nodes start apart, at 1 + spread * N(0, 1) per coordinate (a nonzero mean, so that a bias
    shows; spread 0 is a common start, as after broadcast_parameters). Each step is a local
    gradient step on every node (on its numerator: z moves by the step over the weight), then
    one mixing iteration (only every ``local_steps`` steps).
    ``codec`` encodes the pushes (lossy ones through compressed PushSum with
    ``consensus_step`` and ``error_feedback``). A record holds the run's settings and:
      consensus_error  sqrt(mean_i ||z_i - xbar||^2), xbar the network's average numerator (in
                       flight included): the exact average when lr = 0, SGP's xbar_k otherwise
      deviation        sqrt(mean_i ||z_i - zmean||^2), the parameter deviation from the nodes' mean
      max_deviation    max_i ||z_i - zmean||
      loss             the global objective at zmean
      bytes            bytes one node pushed per step, on average so far
      drift            ||xbar - xbar_0|| / ||xbar_0||: how far the network average moved (by
                       gradients, or with lr = 0 by a codec that loses mass)
    """
    net = SimNetwork(topology, dim, n=nodes, peers=peers, delay=delay, debias=debias, seed=seed,
                     codec=codec, consensus_step=consensus_step, error_feedback=error_feedback)
    task = make_objective(objective, net.n, dim, seed)
    rng = np.random.default_rng(seed)
    net.params[...] = 1.0 + spread * rng.standard_normal(net.params.shape)
    outer = OuterLoop(local_steps)
    settings = {"topology": net.topology.name, "nodes": net.n, "peers": peers, "lr": lr,
                "delay": delay, "debias": debias, "objective": objective,
                "codec": net.codec.spec, "error_feedback": error_feedback,
                "local_steps": local_steps}
    start = net.average()
    records = [_record(net, task, 0, settings, start)]
    for step in range(1, steps + 1):
        if lr:  # SGP's step on the numerators: z moves by the step over w (local_update.py)
            update = lr * task.gradient(net.params, rng)
            if debias:
                weights = net.weights()
                update /= weights[:, None] if weights.ndim == 1 else weights
            net.params[...] -= update
        if outer.exchanges(step):
            net.step()
        records.append(_record(net, task, step, settings, start))
    return records


def _record(net: SimNetwork, task: Objective, step: int, settings: dict,
            start: np.ndarray) -> dict:
    params = net.params
    mean = params.mean(axis=0)
    spread = np.linalg.norm(params - mean, axis=1)
    average = net.average()
    error = np.linalg.norm(params - average, axis=1)
    return {**settings, "step": step,
            "consensus_error": float(np.sqrt((error**2).mean())),
            "deviation": float(np.sqrt((spread**2).mean())),
            "max_deviation": float(spread.max()),
            "loss": task.loss(mean), "bytes": net.bytes_sent() / net.n / max(step, 1),
            "drift": float(np.linalg.norm(average - start) / np.linalg.norm(start))}
