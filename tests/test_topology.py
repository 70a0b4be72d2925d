"""Every topology for n = 1..64: column-stochastic weights, strong connectivity over its period,
and clear errors for invalid graphs (no MPI needed: graphs are pure data)."""
import numpy as np
import pytest

from hvd_sgp.common import SgpValueError
from hvd_sgp.common.options import resolve
from hvd_sgp.common.topology import (TOPOLOGIES, CustomGraph, ExponentialGraph, make_topology)


def union_reach(topology):
    n = topology.n
    reach = np.eye(n, dtype=bool)
    for phase in topology.phases:
        reach |= phase.matrix() > 0
    closure = reach.copy()
    for _ in range(n):
        closure = closure | ((closure.astype(int) @ reach.astype(int)) > 0)
    return closure


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("peers", [1, 2])
def test_every_topology_is_column_stochastic_and_connected(name, peers):
    for n in range(1, 65):
        if name == "bipartite" and n % 2 and n > 1:
            with pytest.raises(SgpValueError, match="even number"):
                make_topology(name, n, peers)
            continue
        topo = make_topology(name, n, peers)
        for k, phase in enumerate(topo.phases):
            p = phase.matrix()
            assert np.allclose(p.sum(axis=0), 1.0, atol=1e-12), (name, n, k)
            assert (p >= 0).all()
            for i in range(n):
                assert set(phase.in_peers(i)) == {j for j in range(n) if i in phase.out_peers[j]}
        assert union_reach(topo).all(), (name, n)


def test_exponential_matches_the_paper():
    topo = ExponentialGraph(8)
    assert [topo.out_peers(0, k) for k in range(4)] == [(1,), (2,), (4,), (1,)]
    assert ExponentialGraph(6).out_peers(5, 2) == (3,)  # 5 + 4 mod 6
    product = np.eye(16)
    topo = ExponentialGraph(16)
    for k in range(4):
        product = topo.phase(k).matrix() @ product
    assert np.allclose(product, 1 / 16, atol=1e-15)
    assert ExponentialGraph(8, peers=2).out_peers(3, 0) == (4, 5)


def test_symmetric_graphs_are_doubly_stochastic():
    assert make_topology("bipartite", 8).doubly_stochastic
    assert make_topology("complete", 5).doubly_stochastic
    assert make_topology("exponential", 8).doubly_stochastic  # regular, uniform
    irregular = CustomGraph(3, [[[1, 2], [2], [0]]])
    assert not irregular.doubly_stochastic


@pytest.mark.parametrize("phases, message", [
    ([[[0], [0]]], "lists itself"),
    ([[[5], [0]]], "out of range"),
    ([[[1, 1], [0]]], "peer twice"),
    ([[[], []]], "not strongly connected"),
    ([[[1], [0], [0]]], "lists 3 nodes"),
])
def test_invalid_custom_graphs(phases, message):
    with pytest.raises(SgpValueError, match=message):
        CustomGraph(2, phases)


def test_custom_weights_and_callable():
    w = np.array([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    topo = CustomGraph(3, [w])
    assert np.allclose(topo.phase(0).matrix().sum(axis=0), 1)
    assert topo.phase(0).uniform_out(1) and topo.phase(0).out_weights[0] == (0.25, 0.25)
    with pytest.raises(SgpValueError, match="sum to 1"):
        CustomGraph(3, [w * 0.9])
    ring = CustomGraph(4, lambda k: [[(i + 1 + k % 2) % 4] for i in range(4)], period=2)
    assert ring.out_peers(0, 1) == (2,)
    with pytest.raises(SgpValueError, match="period"):
        CustomGraph(4, lambda k: [], period=None)


def test_options_from_environment(monkeypatch):
    monkeypatch.setenv("HVD_SGP_TOPOLOGY", "ring")
    monkeypatch.setenv("HVD_SGP_PEERS", "2")
    monkeypatch.setenv("HVD_SGP_PUSH_SUM", "off")
    opts = resolve()
    assert (opts.topology, opts.peers, opts.push_sum) == ("ring", 2, False)
    assert resolve(topology="complete", peers=1).topology == "complete"  # keyword wins
    monkeypatch.setenv("HVD_SGP_PEERS", "zero")
    with pytest.raises(SgpValueError, match="HVD_SGP_PEERS"):
        resolve()
    monkeypatch.delenv("HVD_SGP_PEERS")
    monkeypatch.setenv("HVD_SGP_TIMEOUT", "-3")
    with pytest.raises(SgpValueError, match="HVD_SGP_TIMEOUT"):
        resolve()
    monkeypatch.delenv("HVD_SGP_TIMEOUT")
    with pytest.raises(SgpValueError, match="unknown"):
        resolve(topology="torus")
    with pytest.raises(SgpValueError, match="mode"):
        resolve(mode="async")


def test_use_before_init_is_a_clear_error():
    from hvd_sgp.common import NotInitializedError, runtime
    if runtime.is_initialized():
        pytest.skip("MPI already initialized in this process")
    with pytest.raises(NotInitializedError, match="init"):
        runtime.rank()


def test_connectivity_check_agrees_with_dense_reachability():
    from hvd_sgp.common.topology import _uniform_phase, _validate_connected
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 8))
        phases = [_uniform_phase([[j for j in range(n) if j != i and rng.random() < 0.3]
                                  for i in range(n)]) for _ in range(int(rng.integers(1, 3)))]
        reach = np.eye(n, dtype=bool)
        for ph in phases:
            reach |= ph.matrix().T > 0  # reach[i, j]: an edge i -> j
        closure = reach.copy()
        for _ in range(n):
            closure |= (closure.astype(int) @ reach.astype(int)) > 0
        try:
            _validate_connected("custom", n, phases)
            accepted = True
        except SgpValueError:
            accepted = False
        assert accepted == bool(closure.all()), [ph.out_peers for ph in phases]


def test_large_graphs_build_quickly():
    import time
    began = time.perf_counter()
    for name in ("exponential", "random", "ring"):
        topo = make_topology(name, 4096, 2)
        assert len(topo.phase(0).in_peers(7)) >= 1
    assert time.perf_counter() - began < 60
