"""The simulator computes what the MPI path computes: run by test_sim.py on 8 ranks.

Every rank is one node running the real PushSumMixer over PeerTransport on an irregular graph
(uneven degrees, one phase with unequal shares) with de-bias and deterministic local gradient
steps; every rank then runs the same steps in the simulator and compares every step's
parameters and weights.
"""
import numpy as np

from hvd_sgp.common import PushSumMixer, allocate, init, runtime
from hvd_sgp.common.topology import CustomGraph
from hvd_sgp.common.transport import PeerTransport
from hvd_sgp.sim import SimNetwork
from mpi_checks import Checks

STEPS, DIM, LR = 12, 5, 0.1


def graph(n: int) -> CustomGraph:
    uneven = [[(i + 1) % n] + ([(i + 3) % n, (i + 6) % n] if i % 3 == 0 else []) for i in range(n)]
    shares = np.zeros((n, n))
    for i in range(n):
        shares[i, i] = 0.5
        shares[i, (i + 2) % n] = 0.3 if i % 2 else 0.5
        if i % 2:
            shares[i, (i + 5) % n] = 0.2
    return CustomGraph(n, [uneven, shares, [[(i - 1) % n] for i in range(n)]])


def start(node: int) -> np.ndarray:
    return np.random.default_rng(node).normal(size=DIM)


def gradient(node: int, step: int, z: np.ndarray) -> np.ndarray:
    return 0.1 * (node + 1) * (z - node) + 0.01 * np.cos(step + node + np.arange(DIM))


init()
comm = runtime.world_comm()
n, me = comm.Get_size(), comm.Get_rank()
checks = Checks("sim", comm.Get_rank, comm.Get_size, comm.Barrier, comm.allgather)


@checks
def check_simulator_agrees_with_mpi():
    topology = graph(n)
    buffer = allocate(DIM, np.float64)
    buffer[:-1] = start(me)
    mixer = PushSumMixer(buffer, topology, PeerTransport(comm))
    assert mixer.track_weight, "the check needs a graph whose weights move"
    history = []
    for k in range(STEPS):
        buffer[:-1] -= LR * gradient(me, k, buffer[:-1])
        mixer.mix()
        history.append(np.append(buffer[:-1], mixer.weight))
    mpi = np.stack(comm.allgather(np.array(history)), axis=1)  # (step, node, DIM + 1)
    net = SimNetwork(topology, DIM)
    for i in range(n):
        net.params[i] = start(i)
    worst = 0.0
    for k in range(STEPS):
        for i in range(n):
            net.params[i] -= LR * gradient(i, k, net.params[i])
        net.step()
        sim = np.column_stack([net.params, net.weights()])
        worst = max(worst, float(np.abs(sim - mpi[k]).max()))
        assert worst <= 1e-12, f"step {k}: simulator and MPI differ by {worst:.3e}"
    spread = float(np.ptp(mpi[-1][:, DIM]))
    return (f"simulator agrees with MPI on {n} ranks over {STEPS} steps: max difference "
            f"{worst:.1e}, weights spread {spread:.3f}")


if __name__ == "__main__":  # compression_checks.py imports the graph and the gradients
    checks.run()
