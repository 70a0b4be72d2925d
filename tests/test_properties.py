"""Property tests of the PushSum core (hypothesis) over random directed graphs, sizes and
delays, run in one process through the simulator, which drives the core's own mixers."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sgp.common.topology import CustomGraph
from hvd_sgp.sim import SimNetwork


@st.composite
def graphs(draw):
    """A random time-varying directed graph: per phase, random out-peers plus a ring edge in
    the first phase so that the union over the period is strongly connected."""
    n = draw(st.integers(2, 24))
    period = draw(st.integers(1, 4))
    phases = []
    for k in range(period):
        phase = []
        for i in range(n):
            others = [j for j in range(n) if j != i]
            peers = set(draw(st.lists(st.sampled_from(others), max_size=3)))
            if k == 0:
                peers.add((i + 1) % n)
            phase.append(sorted(peers))
        phases.append(phase)
    return CustomGraph(n, phases)


@settings(max_examples=40, deadline=None)
@given(graph=graphs(), delay=st.integers(0, 3), steps=st.integers(1, 30),
       seed=st.integers(0, 2**16))
def test_mass_is_conserved_with_messages_in_flight(graph, delay, steps, seed):
    net = SimNetwork(graph, 3, delay=delay, seed=seed)
    net.params[...] = np.random.default_rng(seed).normal(size=net.params.shape)
    numerators, weight = net.mass()
    for _ in range(steps):
        net.step()
        x, w = net.mass()  # nodes plus in flight
        assert np.allclose(x, numerators, rtol=1e-12, atol=1e-12)
        assert abs(w - weight) <= 1e-12 * weight
    net.drain()
    assert net.in_flight()[1] == 0
    assert np.allclose(net.mass()[0], numerators, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(graph=graphs(), seed=st.integers(0, 2**16))
def test_debiased_nodes_reach_the_true_average(graph, seed):
    net = SimNetwork(graph, 2, seed=seed)
    net.params[...] = np.random.default_rng(seed).normal(size=net.params.shape)
    truth = net.params.mean(axis=0)
    for _ in range(400 * graph.period * graph.n):  # slow-mixing graphs need many steps
        net.step()
        if np.abs(net.params - truth).max() < 1e-8:
            break
    assert np.abs(net.params - truth).max() < 1e-8
    assert (net.weights() > 0).all()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3 * (1 << 14) + 5), t=st.floats(1e-3, 1.0),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_the_blocked_numpy_lerp_is_a_lerp(size, t, dtype, seed):
    """How a message is summed in (pushsum.add): the numpy kit's lerp, block by block when no
    framework lent a fused one, equals a + t (b - a) on every element, across block edges."""
    from hvd_sgp.common.arrays import NumpyKit

    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=size).astype(dtype), rng.normal(size=size).astype(dtype)
    expected = a.astype(np.float64) + t * (b.astype(np.float64) - a)
    kit = NumpyKit()
    kit.native_lerp = None
    kit.lerp(a, b, t)
    assert np.allclose(a, expected, rtol=0, atol=8 * np.finfo(dtype).eps)
