"""The framework-free SGP driver behind every DistributedOptimizer.

An adapter hands it flat numpy buffers (one per dtype: parameters + weight slot, see
pushsum.allocate) and, each step, flat gradients. The engine averages gradients exactly inside
the node (or across the world in ``mode='allreduce'``), and after the adapter's local step runs
the mode's exchange: PushSum over the cross-node graph (``sgp``), symmetric pairwise averaging
(``dpsgd``) or nothing (``allreduce``).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
from mpi4py import MPI

from hvd_sgp.common import runtime
from hvd_sgp.common.compression import CODECS
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import SgpOptions
from hvd_sgp.common.pushsum import PushSumMixer, average_in_node
from hvd_sgp.common.topology import BipartiteExponentialGraph, make_topology
from hvd_sgp.common.transport import PeerTransport


class GossipEngine:
    """SGP state of one optimizer on this rank."""

    def __init__(self, buffers: Sequence[np.ndarray], options: SgpOptions,
                 signature: Sequence[tuple], compression: str = "none"):
        self.options = options
        self.buffers = list(buffers)
        self.world = runtime.world_comm()
        self.local = runtime.local_comm()
        cross = runtime.cross_comm()
        check_consistent(self.world, [tuple(map(str, s)) for s in signature],
                         options.describe() + (compression,))
        if options.mode == "dpsgd":
            topology = BipartiteExponentialGraph(cross.Get_size(), options.peers)
            push_sum = False
        else:
            topology = make_topology(options.topology, cross.Get_size(), options.peers)
            push_sum = options.push_sum
        self.topology = topology
        self.transport = PeerTransport(cross, options.timeout)
        self.mixers = [PushSumMixer(buf, topology, self.transport, self.local, push_sum,
                                    CODECS[compression]) for buf in self.buffers]
        self.steps = 0
        if cross.Get_size() == 1 and self.world.Get_size() > 1 and self.world.Get_rank() == 0:
            print(f"hvd_sgp: all {self.world.Get_size()} ranks share one node, so gradients are "
                  "averaged exactly and nothing is gossiped; set HVD_SGP_LOCAL_SIZE=1 to make "
                  "every rank its own SGP node", file=sys.stderr, flush=True)

    @property
    def iteration(self) -> int:
        return self.steps

    def reduce_gradients(self, grads: np.ndarray) -> None:
        """Average gradients in place: over the node, or over the world for AllReduce SGD."""
        if self.options.mode == "allreduce":
            if self.world.Get_size() > 1:
                self.world.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
                grads /= self.world.Get_size()
        else:
            average_in_node(grads, self.local)

    def communicate(self) -> None:
        """The exchange that follows each local step."""
        self.steps += 1
        if self.options.mode == "allreduce":
            return
        pending = [mixer.begin() for mixer in self.mixers]
        for mixer, p in zip(self.mixers, pending):
            mixer.finish(p)

    def drain(self) -> None:
        """Complete every exchange in flight (synchronous modes have none between steps)."""

    def average_parameters(self) -> None:
        """Exact consensus: every rank gets sum_i(w_i z_i) / sum_i(w_i), and weight 1."""
        for mixer, buf in zip(self.mixers, self.buffers):
            x = buf[:-1]
            weight = mixer.weight
            if mixer.track_weight:
                x *= weight
            total = np.array([weight], dtype=np.float64)
            self.world.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            self.world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
            x /= total[0] if mixer.track_weight else self.world.Get_size()
            buf[-1] = 1

    def state(self) -> dict:
        return {"iteration": self.steps, "weights": [float(b[-1]) for b in self.buffers],
                "mixer_iterations": [m.iteration for m in self.mixers]}

    def load_state(self, state: dict) -> None:
        weights = state["weights"]
        if len(weights) != len(self.buffers):
            raise SgpValueError(f"checkpoint has {len(weights)} PushSum buffers, this model "
                                f"has {len(self.buffers)}")
        self.steps = int(state["iteration"])
        for buf, w, m, k in zip(self.buffers, weights, self.mixers, state["mixer_iterations"]):
            buf[-1] = w
            m.iteration = int(k)

    def metrics(self) -> dict:
        """Cheap per-rank figures (no communication)."""
        stats = self.transport.stats
        return {"weight": self.mixers[0].weight if self.mixers else 1.0,
                "wait_seconds": stats.last_wait_seconds,
                "total_wait_seconds": stats.wait_seconds,
                "bytes_sent": stats.bytes_sent, "iteration": self.steps}

    def close(self) -> None:
        self.transport.free()


def check_consistent(comm: MPI.Comm, signature: list, opts: tuple) -> None:
    """One allgather: every rank must have the same parameters (count, shapes, dtypes, order)
    and the same SGP options; otherwise raise on every rank naming those that differ."""
    everyone = comm.allgather((signature, opts))
    for what, index in (("parameters (names, shapes, dtypes, order)", 0), ("SGP options", 1)):
        differ = [r for r, entry in enumerate(everyone) if entry[index] != everyone[0][index]]
        if differ:
            detail = _first_difference(everyone[0][index], everyone[differ[0]][index])
            raise SgpValueError(f"ranks {differ} have different {what} from rank 0: {detail}")


def _first_difference(a, b) -> str:
    if len(a) != len(b):
        return f"{len(b)} entries against rank 0's {len(a)}"
    for x, y in zip(a, b):
        if x != y:
            return f"{y!r} where rank 0 has {x!r}"
    return "differ"
