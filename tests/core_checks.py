"""Checks of the PushSum core on real MPI processes; run by test_core.py on n ranks (see
mpi_checks.py for the harness)."""
import math

import numpy as np
from hvd_sgp.common.mpi import MPI

from hvd_sgp.common import PushSumMixer, allocate, gossip_average, init
from hvd_sgp.common import runtime
from hvd_sgp.common.node import in_node
from hvd_sgp.common.topology import CustomGraph, RandomGraph, make_topology
from hvd_sgp.common.errors import TopologyError
from hvd_sgp.common.transport import PeerTransport
from mpi_checks import Checks, expect_error

init()
comm = runtime.world_comm()
n, me = comm.Get_size(), comm.Get_rank()
transport = PeerTransport(comm)


checks = Checks("core", comm.Get_rank, comm.Get_size, comm.Barrier)


def mixer_for(topology, values, **kwargs):
    buf = allocate(values.size, np.float64)
    buf[:-1] = values
    return buf, PushSumMixer(buf, topology, transport, **kwargs)


def totals(buf, mixer):
    """Network sums of numerators x = w z and of weights."""
    w = mixer.weight
    x = comm.allreduce(float((buf[:-1] * w).sum()))
    return x, comm.allreduce(w)


@checks
def check_mass_conservation():
    rng = np.random.default_rng(100 + me)
    for peers in (1, 2):
        topo = RandomGraph(n, peers=peers, seed=7, period=32)
        buf, mixer = mixer_for(topo, rng.normal(size=64), track_weight=True)
        x0, w0 = totals(buf, mixer)
        for _ in range(1000):
            mixer.mix()
        x1, w1 = totals(buf, mixer)
        assert abs(x1 - x0) <= 1e-12 * max(1.0, abs(x0)), (x0, x1)
        assert abs(w1 - w0) <= 1e-12 * n, (w0, w1)
        assert math.isclose(w0, n)
    checks.ok("mass conservation over 1000 random-graph steps")


@checks
def check_exponential():
    values = np.random.default_rng(me).normal(size=1000)
    truth = comm.allreduce(values) / n
    buf, mixer = mixer_for(make_topology("exponential", n), values)
    errors = [np.abs(buf[:-1] - truth).max()]
    m = max(1, math.ceil(math.log2(n))) if n > 1 else 0
    for _ in range(max(m, 12)):
        mixer.mix()
        errors.append(comm.allreduce(float(np.abs(buf[:-1] - truth).max()), op=MPI.MAX))
    if n & (n - 1) == 0:
        assert errors[m] <= 1e-12, (n, errors)
        checks.ok(f"exponential graph exact after log2(n)={m} steps")
    else:
        # not a power of two: the error shrinks by a constant factor per period of m steps
        period = len(make_topology("exponential", n).phases)
        ratios = [errors[k + period] / errors[k] for k in range(1, len(errors) - period)]
        assert errors[-1] < 1e-2 * errors[0] and max(ratios) < 0.9, errors
        checks.ok(f"exponential graph error falls geometrically on n={n}: {errors[-1]:.2e}")


@checks
def check_complete():
    values = np.random.default_rng(me).normal(size=100)
    truth = comm.allreduce(values) / n
    buf, mixer = mixer_for(make_topology("complete", n), values)
    mixer.mix()
    assert np.abs(buf[:-1] - truth).max() <= 1e-12
    checks.ok("complete graph exact after one step")


@checks
def check_symmetric_keeps_weights():
    if n % 2 and n > 1:
        return
    buf, mixer = mixer_for(make_topology("bipartite", n), np.full(10, float(me)),
                           track_weight=True)
    for _ in range(50):
        mixer.mix()
        assert mixer.weight == 1.0, mixer.weight
    checks.ok("bipartite (doubly stochastic) mixing keeps every weight at 1")


def irregular(nodes):
    """Node 0 pushes to everyone, the others only to their successor: column-stochastic,
    not doubly stochastic, so the limit without de-bias is weighted."""
    return CustomGraph(nodes, [[[j for j in range(nodes) if j != i] if i == 0
                                else [(i + 1) % nodes] for i in range(nodes)]])


@checks
def check_debias():
    if n < 3:
        return
    values = np.full(4, float(me))
    truth = (n - 1) / 2
    results = {}
    for push_sum in (True, False):
        buf, mixer = mixer_for(irregular(n), values, push_sum=push_sum)
        for _ in range(300):
            mixer.mix()
        results[push_sum] = comm.allreduce(float(np.abs(buf[:-1] - truth).max()), op=MPI.MAX)
    assert results[True] < 1e-9, results
    assert results[False] > 0.05, results
    checks.ok(f"de-bias: error {results[True]:.1e} with the weight, {results[False]:.2f} without")


@checks
def check_sharded_node():
    """Two-rank nodes: each local rank carries half the buffer; result equals unsharded."""
    if n % 2 or n < 4:
        return
    local = comm.Split(me // 2, key=me)
    cross = comm.Split(local.Get_rank(), key=me)
    node = me // 2
    values = np.arange(11, dtype=np.float64) + 100 * node
    buf = allocate(values.size, np.float64)
    buf[:-1] = values
    mixer = PushSumMixer(buf, irregular(n // 2) if n // 2 >= 3 else make_topology("ring", n // 2),
                         PeerTransport(cross), shard=in_node(local))
    for _ in range(200):
        mixer.mix()
    truth = np.arange(11) + 100 * (n // 2 - 1) / 2
    assert np.abs(buf[:-1] - truth).max() < 1e-9, buf
    stats = mixer.transport.stats
    per_message = stats.bytes_sent / stats.messages_sent
    assert per_message <= 7 * 8, per_message  # a shard (<= 6) and the weight, not all 11
    checks.ok("node-sharded gossip reaches the average with half-size messages")


@checks
def check_gossip_average_and_codecs():
    from hvd_sgp.common.codecs import codec
    values = np.random.default_rng(me).normal(size=(3, 5)).astype(np.float32)
    truth = comm.allreduce(values) / n
    out = gossip_average(values, steps=60)
    assert out.shape == values.shape and np.abs(out - truth).max() < 1e-5
    for name in ("fp16", "bf16"):
        buf = allocate(15, np.float32)
        buf[:-1] = values.ravel()
        mixer = PushSumMixer(buf, make_topology("complete", n), transport,
                             codec=codec(name), track_weight=True)
        for _ in range(3):
            mixer.mix()
        tolerance = 2e-3 if name == "fp16" else 2e-2
        assert np.abs(buf[:-1] - truth.ravel()).max() < tolerance * (1 + np.abs(truth).max())
    checks.ok("gossip_average and fp16/bf16 wire codecs")


@checks
def check_bad_input():
    make_topology("exponential", n + 1).phases  # valid graph for n + 1 nodes...
    expect_error(TopologyError, lambda: PushSumMixer(allocate(3), make_topology(
        "exponential", n + 1), transport), rank=me)  # ...but not for n
    expect_error(TopologyError, lambda: make_topology("hypercube", n), rank=me)
    return "bad input raises typed errors naming the rank"


checks.run()
