"""Properties of compressed PushSum (hvd_sgp/common/choco.py) and random-k gossip
(sparse.py), pinned with hypothesis over random directed time-varying graphs, delays, codecs
and consensus steps, in one process through the simulator (which drives the core's own
mixers):

- with an exact codec and gamma = 1 the compressed path computes what today's PushSum does;
- with any codec, with or without error feedback, the network's numerators and weights (plus
  what is in flight) are conserved, so the de-biased average cannot drift; pushing the
  codecs' encodings naively (today's mixer) loses it;
- with consensus steps inside CHOCO's stability condition (the defaults for int8 and
  random-k, gamma = F for top-k, whose default 3 sqrt(F) is tuned for training from a common
  start), nodes reach consensus on the true average from any start, and SGP converges on a
  quadratic (within 1 / gamma of exact SGP's step-size bias), on every topology; training
  from a common start converges with every default.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sgp.common.codecs import codec
from hvd_sgp.common.topology import TOPOLOGIES, ExponentialGraph, make_topology
from hvd_sgp.sim import SimNetwork, simulate
from hvd_sgp.sim.objectives import Quadratic
from test_properties import graphs

LOSSY = ["int8", "int8:stochastic", "int4", "int2", "int2:stochastic", "topk:0.3", "topk:0.1",
         "randomk:0.3"]


def spread_out(net: SimNetwork, seed: int) -> None:
    net.params[...] = 1 + np.random.default_rng(seed).normal(size=net.params.shape)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(9, 33), delay=st.integers(0, 3), steps=st.integers(1, 25),
       seed=st.integers(0, 2**16))
def test_an_exact_codec_computes_todays_pushsum(n, delay, steps, seed):
    """Exponential graphs have a period above every delay here, so messages on one edge never
    overtake each other; then even Overlap SGP's arrivals match step for step."""
    graph = ExponentialGraph(n)
    today = SimNetwork(graph, 4, delay=delay, seed=seed)
    compressed = SimNetwork(graph, 4, delay=delay, seed=seed, compressed=True,
                            consensus_step=1.0)
    assert type(compressed.mixers[0]).__name__.startswith("Choco")
    for net in (today, compressed):
        spread_out(net, seed)
    for _ in range(steps):
        today.step()
        compressed.step()
        assert np.allclose(compressed.params, today.params, rtol=1e-12, atol=1e-12)
        assert np.allclose(compressed.weights(), today.weights(), rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(graph=graphs(), seed=st.integers(0, 2**16))
def test_an_exact_codec_computes_todays_pushsum_on_any_synchronous_graph(graph, seed):
    today = SimNetwork(graph, 3, seed=seed)
    compressed = SimNetwork(graph, 3, seed=seed, compressed=True, consensus_step=1.0)
    for net in (today, compressed):
        spread_out(net, seed)
    for _ in range(12):
        today.step()
        compressed.step()
    assert np.allclose(compressed.params, today.params, rtol=1e-12, atol=1e-12)
    assert np.allclose(compressed.weights(), today.weights(), rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(graph=graphs(), delay=st.integers(0, 3), spec=st.sampled_from(LOSSY),
       feedback=st.booleans(), step=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_compressed_gossip_conserves_the_average(graph, delay, spec, feedback, step, seed):
    """Random-k's weights are per entry (per run): its mass is checked entry by entry."""
    net = SimNetwork(graph, 6, delay=delay, seed=seed, codec=spec, error_feedback=feedback,
                     consensus_step=step)
    spread_out(net, seed)
    numerators, weight = net.mass()
    scale = np.abs(numerators).max()
    for _ in range(20):
        net.step()
        x, w = net.mass()  # nodes plus in flight
        assert np.abs(x - numerators).max() <= 1e-12 * scale
        assert np.abs(w - weight).max() <= 1e-12 * np.max(weight)
    net.drain()
    assert np.abs(net.in_flight()[1]).max() <= 1e-12 * np.max(weight)
    x, w = net.mass()
    assert np.abs(x - numerators).max() <= 1e-12 * scale
    assert np.abs(w - weight).max() <= 1e-12 * np.max(weight)


@pytest.mark.parametrize("spec", ["int8", "topk:0.25", "randomk:0.25"])
def test_naive_pushes_lose_the_average_and_compressed_gossip_keeps_it(spec):
    drifts = {}
    for compressed in (False, True):
        net = SimNetwork("random", 8, n=16, codec=spec, compressed=compressed, seed=1)
        spread_out(net, 1)
        start = net.average()
        for _ in range(30):
            net.step()
        drifts[compressed] = np.linalg.norm(net.average() - start) / np.linalg.norm(start)
    assert drifts[True] < 1e-13 < 1e-3 < drifts[False], drifts


def topologies(n: int) -> list:
    return [make_topology(name, n) for name in TOPOLOGIES if name != "bipartite" or n % 2 == 0]


STABLE = {"int8": None, "int4": None, "int2": None, "topk:0.25": 0.25,
          "randomk:0.25": None}  # None: the codec's default


@pytest.mark.parametrize("spec", sorted(STABLE))
@pytest.mark.parametrize("n", [6, 11])
def test_consensus_from_any_start_on_every_topology(spec, n):
    worst = {}
    for topology in topologies(n):
        net = SimNetwork(topology, 8, codec=spec, seed=2, consensus_step=STABLE[spec])
        spread_out(net, 2)
        truth = net.average()
        for _ in range(6000):
            net.step()
            error = np.abs(net.params - truth).max()
            if error < 1e-9:
                break
        worst[topology.name] = error
    assert max(worst.values()) < 1e-9, worst


@settings(max_examples=12, deadline=None)
@given(graph=graphs(), spec=st.sampled_from(sorted(STABLE)), delay=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_compressed_sgp_converges_on_a_quadratic_as_exact_sgp_does(graph, spec, delay, seed):
    """SGP with a decaying step on f = mean_i f_i (different curvatures and minimisers per
    node, exact gradients), from a common start. Both end with a bias proportional to the
    step over the mixing rate (slow-mixing graphs leave more); compressed gossip mixes about
    gamma times slower, so its error keeps shrinking with the step and ends within 1 / gamma
    of exact gossip's on the same graph. Random-k mixes each entry in a fraction F of the
    steps, on a random subsequence of a periodic graph's phases: it is held to gamma = F / 2
    (its codec's consensus step). Where weights stay uneven (graphs that are not doubly
    stochastic), local steps on de-biased parameters weigh the nodes' gradients by their
    weights, which leaves exact SGP a floor; random-k's per-run weights settle at a floor of
    their own, which it may reach from below, so there only the bound is asserted."""
    errors = []
    gamma = STABLE[spec] or codec(spec).consensus_step
    for codec_spec, step in (("none", None), (spec, STABLE[spec])):
        net = SimNetwork(graph, 4, delay=delay, seed=seed, codec=codec_spec,
                         consensus_step=step)
        task = Quadratic(net.n, 4, seed=seed, noise=0.0)
        rng = np.random.default_rng(seed)
        net.params[...] = 0.0
        for k in range(2000):
            net.params[...] -= 0.3 / (1 + k / 20) * task.gradient(net.params, rng)
            net.step()
            if k + 1 in (500, 2000):
                errors.append(np.abs(net.params - task.optimum).max()
                              / np.abs(task.optimum).max())
    exact, (early, late) = errors[1], errors[2:]
    settles = codec(spec).name == "randomk" and not graph.doubly_stochastic
    assert (settles or late <= early + 1e-9) and late <= exact / gamma + 0.02, (errors, gamma)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_simulate_trains_with_codecs_and_local_steps(name):
    n = 8
    base = dict(topology=name, nodes=n, steps=200, lr=0.05, spread=0.0, dim=16)
    exact = simulate(**base)[-1]
    for spec in ("int8", "topk:0.25"):
        for local_steps in (1, 4):
            last = simulate(codec=spec, local_steps=local_steps, **base)[-1]
            assert last["loss"] < exact["loss"] * 1.05, (spec, local_steps, last, exact)
            assert last["bytes"] < exact["bytes"] / (local_steps if spec == "int8" else 1)
    assert codec("topk:0.25").differential and not codec("fp16").differential


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), fraction=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
       levels=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_topk_selects_the_largest_differences_ties_by_position(n, fraction, levels, seed):
    """Few distinct magnitudes make ties at the k-th value common (the sample's threshold
    then takes its fallbacks): the selection must still be the k largest |values -
    reference|, ties broken by position, in increasing index order."""
    rng = np.random.default_rng(seed)
    reference = rng.integers(-3, 3, n).astype(np.float32)
    values = reference + rng.integers(-levels, levels + 1, n).astype(np.float32)
    c = codec(f"topk:{fraction}")
    index, kept = c.select(values, reference)
    k = c.count(n)
    expected = np.sort(np.argsort(-np.abs(values - reference), kind="stable")[:k])
    assert np.array_equal(index, expected)
    assert np.array_equal(kept, (values - reference)[expected])


@pytest.mark.parametrize("spec", ["int8", "int8:stochastic", "int4", "int2:stochastic",
                                  "topk:0.01", "randomk:0.05"])
def test_encoding_a_difference_equals_encoding_it_formed(spec):
    """encode_delta works block by block without forming values - reference; its bytes are
    those of encoding the difference, and the copy it moves gets what a receiver decodes."""
    n = 200_003  # several blocks and a partial last one
    rng = np.random.default_rng(3)
    values, reference = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(
        np.float32)
    fused, formed = codec(spec), codec(spec)  # stochastic rounding: same generator state
    wire, expected = (np.zeros(fused.nbytes(n), np.uint8) for _ in range(2))
    copy = reference.copy()
    fused.encode_delta(values, reference, wire, copy=copy, seed=9)
    formed.encode_delta(values - reference, None, expected, seed=9)
    assert np.array_equal(wire, expected)
    received = reference.copy()
    formed.add_to(expected, n, received)
    assert np.array_equal(copy, received)


def doubly_stochastic(n: int) -> list:
    return [t for t in topologies(n) if t.doubly_stochastic]


@pytest.mark.parametrize("n", [2, 5, 8])
def test_random_k_mixes_shared_entries_exactly(n):
    """Random-k on a synchronous doubly stochastic graph: at each step every node changes
    only the entries drawn for that step, exactly as today's PushSum would change them from
    the same state; the others keep their values; the sum over nodes never moves (float64:
    to rounding); no public copies, and bytes are the drawn values plus seed and weight."""
    dim = 5000
    for topology in doubly_stochastic(n):
        net = SimNetwork(topology, dim, codec="randomk:0.1")
        assert type(net.mixers[0]).__name__ == "SparseMixer"
        spread_out(net, n)
        total = net.params.sum(axis=0)
        for k in range(2 * topology.period + 3):
            exact = SimNetwork(topology, dim)
            exact.params[...] = net.params
            for mixer in exact.mixers:
                mixer.iteration = k
            before = net.params.copy()
            exact.step()
            net.step()
            drawn = codec("randomk:0.1").draw(k, dim).gather(np.arange(dim))
            others = np.setdiff1d(np.arange(dim), drawn)
            assert np.array_equal(net.params[:, drawn], exact.params[:, drawn])
            assert np.array_equal(net.params[:, others], before[:, others])
            assert np.abs(net.params.sum(axis=0) - total).max() <= 1e-12 * np.abs(total).max()
        pushes = sum(len(topology.phase(k).out_peers[0]) for k in range(2 * topology.period + 3))
        count = codec("randomk:0.1").count(dim)
        assert net.mixers[0].transport.stats.bytes_sent == pushes * (8 + 8 * count + 8)


@settings(max_examples=30, deadline=None)
@given(graph=graphs(), delay=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_random_k_drawing_every_entry_is_todays_pushsum_on_any_graph(graph, delay, seed):
    """Where weights move (Overlap SGP, irregular graphs) random-k keeps a weight per run;
    drawing every entry (F = 1) it must compute exactly what today's PushSum does, weights
    included, step for step, with the same arrivals."""
    today = SimNetwork(graph, 5, delay=delay, seed=seed)
    sparse = SimNetwork(graph, 5, delay=delay, seed=seed, codec="randomk:1")
    mixer = sparse.mixers[0]
    assert type(mixer).__name__ == "SparseMixer" and mixer.overlapped == bool(delay)
    for net in (today, sparse):
        spread_out(net, seed)
    for _ in range(15):
        today.step()
        sparse.step()
        assert np.array_equal(sparse.params, today.params)
        weights = sparse.weights()
        expected = today.weights()
        assert np.array_equal(weights, np.broadcast_to(expected[:, None], weights.shape)
                              if weights.ndim == 2 else expected)


@pytest.mark.parametrize("topology, delay", [("exponential", 2), ("random", 0),
                                             ("ring", 3)])
def test_random_k_moves_weights_run_by_run_where_they_move(topology, delay):
    """Overlap SGP and irregular graphs: only drawn runs change value or weight at a step, a
    push carries one float64 share per drawn run besides its values, and the nodes still
    reach the exact average of every entry."""
    dim = 5000  # one entry per run (run = 1 below 8192 values)
    net = SimNetwork(topology, dim, n=6, codec="randomk:0.1", delay=delay, seed=4)
    spread_out(net, 4)
    numerators, weight = net.mass()
    c = codec("randomk:0.1")
    for k in range(20):
        before, weights = net.params.copy(), net.weights()
        net.step()
        untouched = np.setdiff1d(np.arange(dim), np.concatenate(
            [c.draw(j, dim).gather(np.arange(dim)) for j in range(max(0, k - delay), k + 1)]))
        assert np.array_equal(net.params[:, untouched], before[:, untouched])
        assert np.array_equal(net.weights()[:, untouched], weights[:, untouched])
    assert net.weights().std() > 0.01  # weights moved
    pushes = sum(len(net.topology.phase(k).out_peers[0]) for k in range(20))
    assert net.mixers[0].transport.stats.bytes_sent == pushes * (8 + 16 * c.count(dim) + 8)
    for _ in range(4000):
        net.step()
    net.drain()
    assert np.abs(net.params - numerators / weight).max() < 1e-9


def test_bf16_rounds_to_nearest_even_block_by_block():
    """bf16 encodes several blocks and a partial one without whole-array temporaries: each
    value goes to the nearer of the two bf16 values around it (an exact tie to the even
    one), and decoding widens exactly."""
    n = 150_001
    rng = np.random.default_rng(4)
    values = (rng.normal(size=n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    values[:4] = [0.0, -0.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8]  # ties: down to 1, up to 1 + 2^-6
    c = codec("bf16")
    wire = np.zeros(c.nbytes(n), np.uint8)
    c.encode(values, wire)
    decoded = c.decode(wire, n).astype(np.float64)
    bits = values.view(np.uint32)
    low = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    high = ((bits | np.uint32(0xFFFF)) + np.uint32(1)).view(np.float32).astype(np.float64)
    exact = values.astype(np.float64)
    nearer = np.where(np.abs(exact - low) < np.abs(high - exact), low, high)
    tie = np.abs(exact - low) == np.abs(high - exact)
    even = np.where((bits >> np.uint32(16)) & np.uint32(1), high, low)
    assert np.array_equal(decoded, np.where(tie, even, nearer))
    assert decoded[2] == 1 and decoded[3] == 1 + 2.0**-6


NARROW = ["int8", "int4", "int2", "int4:stochastic", "int2:stochastic"]


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(NARROW), n=st.integers(1, 3000), seed=st.integers(0, 2**16))
def test_block_scaled_integers_bytes_and_error_bound(spec, n, seed):
    """The wire holds one float32 scale per chunk (its largest magnitude / LEVELS), then the
    codes, 8 / BITS to a byte, the first in the low bits, offset by LEVELS; a value decodes
    within half a step of itself (a whole step when rounding stochastically)."""
    c = codec(spec)
    rng = np.random.default_rng(seed)
    values = (rng.normal(size=n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    chunks = -(-n // c.CHUNK)
    bits = {"int8": 8, "int4": 4, "int2": 2}[c.name]
    assert c.nbytes(n) == 4 * chunks + -(-n * bits // 8)
    wire = np.zeros(c.nbytes(n), np.uint8)
    c.encode(values, wire)
    scales = wire[:4 * chunks].view(np.float32)
    tops = np.array([np.abs(values[i:i + c.CHUNK]).max() for i in range(0, n, c.CHUNK)])
    assert np.allclose(scales, tops / c.LEVELS, rtol=1e-6, atol=0)
    step = np.repeat(scales, c.CHUNK)[:n]
    if bits == 8:
        codes = wire[4 * chunks:].view(np.int8).astype(np.int64)
    else:
        packed = wire[4 * chunks:].astype(np.int64)
        lanes = [(packed >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)]
        codes = np.stack(lanes, axis=1).reshape(-1)[:n] - c.LEVELS
    assert np.abs(codes).max() <= c.LEVELS
    decoded = c.decode(wire, n)
    assert np.allclose(decoded, codes * step, rtol=1e-6, atol=0)
    slack = 1.0 if c.rounding == "stochastic" else 0.5
    assert np.all(np.abs(decoded - values) <= slack * step * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("spec", ["int4", "int2", "int2:stochastic"])
def test_error_feedback_sends_later_what_the_codec_dropped(spec):
    """Pushing a fixed difference against a public copy that moves by what each push decodes
    to (compressed PushSum's error feedback): the pushes add up to the difference less what
    is still held back, and that residual shrinks to nothing, so nothing is lost for good."""
    n = 5000
    c = codec(spec)
    target = np.random.default_rng(5).normal(size=n).astype(np.float32)
    copy, sent = np.zeros(n, np.float32), np.zeros(n, np.float64)
    wire = np.zeros(c.nbytes(n), np.uint8)
    residuals = []
    for _ in range(60 if c.rounding == "nearest" else 300):  # stochastic: slower, unbiased
        received = np.zeros(n, np.float32)
        c.encode_delta(target, copy, wire, copy=copy)
        c.add_to(wire, n, received)
        sent += received
        assert np.allclose(sent + (target - copy), target, rtol=0, atol=1e-5)
        residuals.append(np.linalg.norm(target - copy) / np.linalg.norm(target))
    assert residuals[0] > 0.05 if c.name == "int2" else residuals[0] > 1e-3
    assert residuals[-1] < 1e-5, residuals[::10]
