"""Outer optimizers (hvd_sgp/common/outer.py, outer_steps.py).

In one process, through the simulator's PushSum (the core's mixers), with hypothesis over
random directed graphs: the outer step over gossip leaves every PushSum weight as it is (they
sum to n), gossip rounds between outer steps conserve the numerators, the outer step moves the
numerators by exactly sum_i w_i (new z_i - z_i), and on a graph whose weights stay 1 the
network's average follows DiLoCo on the averaged pseudo-gradient exactly. On real MPI
(outer_checks.py, 4 ranks): DiLoCo over AllReduce and over gossip, factories, resume;
(keras_outer_checks.py, 2 ranks) a Keras optimizer as the outer step, under Keras 3 and tf_keras.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sgp.common import options
from hvd_sgp.common.errors import OptionError, SgpValueError
from hvd_sgp.common.outer import OuterLoop
from hvd_sgp.common.mixers import build
from hvd_sgp.common.outer_steps import MomentumStep, parse
from hvd_sgp.common.pushsum import exchange
from hvd_sgp.common.topology import ExponentialGraph
from hvd_sgp.runner import launch
from hvd_sgp.sim import SimNetwork
from hvd_sgp.sim.network import Mailbox, SimTransport
from mpi_launch import SharedChecks
from test_properties import graphs

SPECS = ["diloco", "nesterov:0.5:0.8", "heavyball:1:0.5", "sgd:0.7", "sgd:1"]


CHECKS = SharedChecks("outer_checks.py", worlds=[4])
KERAS = {"0": SharedChecks("keras_outer_checks.py", worlds=[2], needs="tensorflow"),  # Keras 3
         "1": SharedChecks("keras_outer_checks.py", worlds=[2], env={"TF_USE_LEGACY_KERAS": "1"},
                           needs="tf_keras")}
TWO_RANK_NODES = SharedChecks("outer_checks.py", "check_diloco_over_allreduce",
                              "check_diloco_over_gossip", "check_outer_state_resumes_exactly",
                              worlds=[4], local_size="2")


def test_outer_checks_on_four_ranks():
    out = CHECKS.run(4)
    print(out)
    assert "all outer checks passed on 4 ranks" in out


def test_two_rank_nodes():
    """HVD_SGP_LOCAL_SIZE=2: each local rank gossips its shard, and every local rank takes
    the node's outer step alike."""
    out = TWO_RANK_NODES.run(4)
    assert "all outer checks passed on 4 ranks" in out


@pytest.mark.parametrize("legacy", ["0", "1"])
def test_keras_outer_optimizer(legacy):
    """A Keras optimizer (Keras 3, or tf_keras) as the outer step, on 2 ranks."""
    pytest.importorskip("tensorflow")
    if legacy == "1":
        pytest.importorskip("tf_keras")
    out = KERAS[legacy].run(2, timeout=600)
    print(out)
    assert "all keras outer checks passed on 2 ranks" in out
    assert ("tf_keras SGD" if legacy == "1" else "keras SGD") in out


def test_presets_and_the_options_table():
    diloco = parse("diloco")
    assert (diloco.lr, diloco.momentum, diloco.nesterov) == (0.7, 0.9, True)
    assert repr(parse("Heavyball:1:0.5")) == "heavyball:1:0.5"
    assert options.resolve(outer_optimizer="diloco").outer_optimizer == "diloco"
    for bad in ("adam", "sgd", "sgd:0", "nesterov:1:2", "nesterov:x:0.9"):
        with pytest.raises(OptionError, match="outer_optimizer"):
            options.resolve(outer_optimizer=bad)
    with pytest.raises(OptionError, match="HVD_SGP_OUTER_OPTIMIZER"):
        options.from_environment("outer_optimizer", {"HVD_SGP_OUTER_OPTIMIZER": "adam"})
    assert options.environment({"outer_optimizer": "diloco"}) == {
        "HVD_SGP_OUTER_OPTIMIZER": "diloco"}
    args = launch.parse_args(["-np", "2", "--outer-optimizer", "nesterov:0.5:0.8", "python"])
    assert launch.sgp_environment(args)["HVD_SGP_OUTER_OPTIMIZER"] == "nesterov:0.5:0.8"
    with pytest.raises(SystemExit):  # argparse names the flag and the problem
        launch.parse_args(["-np", "2", "--outer-optimizer", "adam", "python"])
    args = launch.parse_args(["-np", "2", "--outer-fragments", "4", "python"])
    assert launch.sgp_environment(args)["HVD_SGP_OUTER_FRAGMENTS"] == "4"
    with pytest.raises(OptionError, match="outer_fragments"):
        options.resolve(outer_fragments=0)
    with pytest.raises(SgpValueError, match="outer_fragments=9 needs"):
        OuterLoop(8, outer_optimizer="diloco", fragments=9)
    assert OuterLoop(8, fragments=4).offsets == [0, 2, 4, 6]


def test_nesterov_is_torchs_sgd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    anchor = rng.normal(size=7)
    mine = [anchor.copy()]
    theirs = torch.tensor(anchor.copy())
    opt = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    step = parse("diloco")
    for _ in range(5):
        d = rng.normal(size=7)
        step.apply(mine, [d.copy()], lr=0.1)  # (pseudo is scratch to a step)
        theirs.grad = torch.tensor(d)
        opt.step()
    assert np.allclose(mine[0], theirs.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS + ["slowmo"])
def test_the_blocked_outer_step_is_the_formula_bit_for_bit(monkeypatch, spec):
    """MomentumStep works in blocks (outer_steps.BLOCK: no model-sized temporaries, which
    page-fault afresh at every sync): the same numbers, to the bit, as the formula on whole
    arrays, over a model that is not a whole number of blocks."""
    from hvd_sgp.common import outer_steps
    monkeypatch.setattr(outer_steps, "BLOCK", 4)
    step = MomentumStep(0.8, 0.6, scaled=True) if spec == "slowmo" else parse(spec)
    rng = np.random.default_rng(2)
    mine = [rng.normal(size=11).astype(np.float32)]
    x0, u = mine[0].copy(), np.zeros(11, np.float32)
    for k in range(6):
        lr = 0.1 * (1 + k % 3)
        d = rng.normal(size=11).astype(np.float32)
        rate = lr if step.scaled else 1.0
        g = d / rate if step.scaled else d
        u = u * step.momentum + g
        x0 = x0 - (step.lr * rate) * (g + step.momentum * u if step.nesterov else u)
        step.apply(mine, [d.copy()], lr)
        assert np.array_equal(mine[0], x0), (spec, k)


def test_slowmo_is_the_scaled_heavy_ball_preset():
    """SlowMo's update as the paper writes it, against the loop's preset."""
    loop = OuterLoop(2, slowmo=0.6, slowmo_lr=0.8)
    assert isinstance(loop.step, MomentumStep) and loop.gossips_between
    rng = np.random.default_rng(1)
    buf = [np.append(rng.normal(size=5), 1.0)]
    x0, u = buf[0][:-1].copy(), np.zeros(5)
    loop.update(buf, 0.1)  # records the anchor
    for k in range(6):
        lr = 0.1 * (1 + k % 3)
        buf[0][:-1] += rng.normal(size=5)
        u = 0.6 * u + (x0 - buf[0][:-1]) / lr
        x0 = x0 - 0.8 * lr * u
        loop.update(buf, lr)
        assert np.allclose(buf[0][:-1], x0, rtol=0, atol=1e-12)
    assert buf[0][-1] == 1.0


def gossip_outer(net: SimNetwork, spec: str, rounds: int, local: int, seed: int):
    """Gossip DiLoCo on the simulator: per round ``local`` random local steps on every node,
    one PushSum round, then each node's outer step on its de-biased mix. Yields, per round,
    (mass before the round, mass after it, weights after it, (z, w) before the outer step)."""
    rng = np.random.default_rng(seed)
    loops = [OuterLoop(local, outer_optimizer=spec) for _ in range(net.n)]
    for i, loop in enumerate(loops):
        loop.update([net.buffers[i]], 0.1)  # the first sync records the anchors
    for _ in range(rounds):
        for _ in range(local):
            net.params[...] -= 0.1 * rng.normal(size=net.params.shape)
        before = net.mass()
        net.step()
        after = net.mass()
        mixed = net.buffers.copy()
        for i, loop in enumerate(loops):
            loop.update([net.buffers[i]], 0.1)
        yield before, after, mixed


@settings(max_examples=25, deadline=None)
@given(graph=graphs(), spec=st.sampled_from(SPECS), rounds=st.integers(1, 6),
       local=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_outer_step_over_gossip_conserves_pushsum_mass(graph, spec, rounds, local, seed):
    net = SimNetwork(graph, 3, seed=seed)
    net.params[...] = 1 + np.random.default_rng(seed).normal(size=net.params.shape)
    for before, after, mixed in gossip_outer(net, spec, rounds, local, seed):
        # the round conserves the numerators and the weight (nothing in flight afterwards)
        assert np.allclose(after[0], before[0], rtol=1e-12, atol=1e-12)
        assert after[1] == pytest.approx(net.n, abs=1e-12)
        # the outer step leaves every weight as the round left it
        assert np.array_equal(net.buffers[:, -1], mixed[:, -1])
        assert net.weights().sum() == pytest.approx(net.n, abs=1e-12)
        # and moves the numerators by sum_i w_i (z_i' - z_i), nothing else
        moved = (mixed[:, -1:] * (net.params - mixed[:, :-1])).sum(axis=0)
        assert np.allclose(net.mass()[0] - after[0], moved, rtol=1e-12, atol=1e-12)
        if spec == "sgd:1":  # the identity outer step: the gossip round's mix (to rounding)
            assert np.allclose(net.buffers, mixed, rtol=0, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 33), spec=st.sampled_from(SPECS), rounds=st.integers(1, 8),
       local=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_on_weights_that_stay_one_the_average_follows_diloco(n, spec, rounds, local, seed):
    """Everything is linear and gossip keeps the average: the nodes' mean takes the outer
    step of the mean pseudo-gradient, as DiLoCo over AllReduce would from that mean."""
    net = SimNetwork(ExponentialGraph(n), 4, seed=seed)
    net.params[...] = 1 + np.random.default_rng(seed).normal(size=net.params.shape)
    reference = parse(spec)
    anchor = [net.params.mean(axis=0)]
    progress = []
    for before, after, mixed in gossip_outer(net, spec, rounds, local, seed):
        assert np.array_equal(net.weights(), np.ones(n))
        average = after[0] / n  # the mean of the round's mix = the mean before it
        reference.apply(anchor, [anchor[0] - average], 0.1)
        progress.append(np.abs(net.params.mean(axis=0) - anchor[0]).max())
    assert max(progress) < 1e-9, progress


def streamed(graph, spec: str, fragments: int, period: int, steps: int, seed: int,
             codec: str = "none", dim: int = 11):
    """Streaming gossip DiLoCo on simulated nodes: per step a random local step on every
    node, then the due fragment's PushSum round (its own buffer and weight per node) and its
    outer step. Yields per step (due fragments, per-fragment weights and masses before the
    round, after it, after the outer step, bytes the step sent, models after the round)."""
    rng = np.random.default_rng(seed)
    n = graph.n
    mailbox = Mailbox(0, seed)
    buffers = [np.append(1 + rng.normal(size=dim), 1.0) for _ in range(n)]
    loops = [OuterLoop(period, outer_optimizer=spec, fragments=fragments) for _ in range(n)]
    mixers = [[build(piece, graph, SimTransport(mailbox, i, n), codec=codec)
               for piece in loops[i].gossip_buffers([buffers[i]])] for i in range(n)]

    def masses():
        """Per fragment: (sum of weights, sum of weight x model slice) over the nodes."""
        out = []
        for k, (_, _, start, stop) in enumerate(loops[0]._layout):
            w = [loops[i]._pieces[k][-1] if mixers[i][k].track_weight else 1.0
                 for i in range(n)]
            out.append((sum(w), sum(wi * buffers[i][start:stop] for i, wi in enumerate(w))))
        return out

    for step in range(1, steps + 1):
        for buf in buffers:
            buf[:-1] -= 0.1 * rng.normal(size=dim)
        sent = sum(m.transport.stats.bytes_sent for row in mixers for m in row)
        chosen = [loops[i].gossiping(mixers[i], step, [buffers[i]]) for i in range(n)]
        before = masses()
        exchange([m for row in chosen for m in row])
        for i in range(n):  # the round's mix, before the outer step writes it
            for k, (p, _, start, stop) in enumerate(loops[i]._layout):
                if p in loops[i].due(step):
                    buffers[i][start:stop] = loops[i]._pieces[k][:-1]
        after, mixed = masses(), [b.copy() for b in buffers]
        for i in range(n):
            loops[i].update([buffers[i]], 0.1)
        sent = sum(m.transport.stats.bytes_sent for row in mixers for m in row) - sent
        yield loops[0].due(step), before, after, masses(), sent, mixed, buffers


@settings(max_examples=25, deadline=None)
@given(graph=graphs(), spec=st.sampled_from(SPECS), fragments=st.integers(1, 4),
       extra=st.integers(0, 4), seed=st.integers(0, 2**16),
       codec=st.sampled_from(["none", "int8", "int2"]))
def test_streamed_fragments_conserve_mass_and_send_one_fragment_a_step(
        graph, spec, fragments, extra, seed, codec):
    period = fragments + extra
    syncs = {p: 0 for p in range(fragments)}
    sizes = []
    for due, before, after, outer, sent, mixed, models in streamed(
            graph, spec, fragments, period, 3 * period, seed, codec):
        assert len(due) <= 1  # at most one fragment a step (offsets p*H//P are distinct)
        for p in due:
            syncs[p] += 1
        for p, ((w0, m0), (w1, m1), (w2, m2)) in enumerate(zip(before, after, outer)):
            assert w0 == pytest.approx(graph.n, abs=1e-12) and w2 == w1 == pytest.approx(
                w0, abs=1e-12)
            if codec == "none":  # compressed PushSum keeps mass in its public copies
                assert np.allclose(m1, m0, rtol=1e-12, atol=1e-12)
            if p not in due:
                assert np.allclose(m1, m0, rtol=0, atol=0)
        if not due:
            assert sent == 0
        else:
            sizes.append(sent)
        if spec == "sgd:1":  # the identity outer step leaves each fragment's mix
            assert all(np.allclose(m, x, rtol=0, atol=1e-12) for m, x in zip(mixed, models))
    assert set(syncs.values()) == {3}  # every fragment syncs once every H steps


def test_peak_bytes_fall_p_fold_in_the_simulator():
    """The transport's count: the busiest step sends 1/P of the model, and the run's total
    stays that of syncing the whole model every H steps (plus a weight slot a fragment)."""
    peaks, totals = {}, {}
    for fragments in (1, 2, 4, 8):
        sent = [s for *_, s, _, _ in streamed(ExponentialGraph(8), "diloco", fragments, 8, 16,
                                              0, dim=4000)]
        peaks[fragments], totals[fragments] = max(sent), sum(sent)
    for fragments in (2, 4, 8):
        assert peaks[1] / peaks[fragments] > 0.99 * fragments, peaks
        assert totals[fragments] == pytest.approx(totals[1], rel=0.01), totals



def delayed(graph, spec: str, fragments: int, period: int, delay: int, steps: int, seed: int,
            still: int = 0, dim: int = 9):
    """Gossip DiLoCo with each outer step landing ``delay`` steps after its round began (as
    under Overlap SGP; the simulator's rounds complete at once, the arithmetic is the same).
    Per step every node takes a random local step, none in the ``still`` steps after a
    round began; yields per step (per piece: the sum of weights and of weight x values over
    the nodes, as the round began and at the step's end; the models; the parameter slices
    whose outer step landed)."""
    rng = np.random.default_rng(seed)
    n = graph.n
    mailbox = Mailbox(0, seed)
    buffers = [np.append(1 + rng.normal(size=dim), 1.0) for _ in range(n)]
    loops = [OuterLoop(period, outer_optimizer=spec, fragments=fragments) for _ in range(n)]
    for loop in loops:
        loop.defer(True, delay)
    mixers = [[build(piece, graph, SimTransport(mailbox, i, n))
               for piece in loops[i].gossip_buffers([buffers[i]])] for i in range(n)]
    quiet = set()  # steps without local progress
    for step in range(1, steps + 1):
        noise = rng.normal(size=(n, dim))
        if step not in quiet:
            for buf, x in zip(buffers, noise):
                buf[:-1] -= 0.1 * x
        chosen = [loops[i].gossiping(mixers[i], step, [buffers[i]]) for i in range(n)]
        if any(chosen):
            quiet.update(range(step + 1, step + 1 + still))
        pieces = [[loops[i]._pieces[k] for i in range(n)] for k in range(len(loops[0]._layout))]

        def masses():
            return [(sum(p[-1] for p in row), sum(p[-1] * p[:-1] for p in row))
                    for row in pieces]
        began = masses()
        exchange([m for row in chosen for m in row])
        landed = []
        for i in range(n):
            if loops[i].steps_outer(step):
                landed = [slice(start, stop) for p, _, start, stop in loops[i]._layout
                          if p in loops[i]._landing]
                loops[i].update([buffers[i]], 0.1)
        yield began, masses(), np.array(buffers), landed


@settings(max_examples=25, deadline=None)
@given(graph=graphs(), spec=st.sampled_from(SPECS), fragments=st.integers(1, 3),
       extra=st.integers(0, 3), delay=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_delayed_outer_step_is_the_immediate_one_plus_the_progress_meanwhile(
        graph, spec, fragments, extra, delay, seed):
    """Overlap SGP's delayed outer step against the immediate one (delay 0), same seed.
    Without local progress while a round is out, the two runs are equal bit for bit at
    every landing (x0' + 0.0). With it, the delayed run's landing model minus the immediate
    run's (which took the same outer step on the same mix, had it the same progress before)
    is the progress; and every round conserves each piece's PushSum mass, the outer step
    leaves it, and the weights sum to n."""
    period = fragments + extra + 1
    delay = min(delay, period - 1)
    steps = 3 * period + delay
    reference = [models for *_, models, _ in
                 delayed(graph, spec, fragments, period, 0, steps, seed, still=delay)]
    lands = 0
    for step, (*_, models, landed) in enumerate(
            delayed(graph, spec, fragments, period, delay, steps, seed, still=delay)):
        for part in landed:  # the immediate run has stood at this fragment since its round
            assert np.array_equal(models[:, part], reference[step][:, part]), (step, part)
            lands += 1
    assert lands >= 2 * fragments
    for began, ended, _, _ in delayed(graph, spec, fragments, period, delay, steps, seed):
        for (w0, m0), (w1, m1) in zip(began, ended):
            assert w0 == pytest.approx(graph.n, abs=1e-12) and w1 == pytest.approx(w0, abs=1e-12)
            assert np.allclose(m1, m0, rtol=1e-12, atol=1e-12)




def test_the_landing_model_is_the_new_anchor_plus_the_progress():
    """One fragment, H = 4, delay 2, on 4 nodes, same seed with and without progress while
    the round is out: at each landing the two models differ by exactly the local steps
    taken since the round began (the run without them stands at the new anchor, as an
    immediate outer step would)."""
    graph, period, delay, steps, dim = ExponentialGraph(4), 4, 2, 12, 9
    moving = [m for *_, m, _ in delayed(graph, "diloco", 1, period, delay, steps, 7, dim=dim)]
    still = [m for *_, m, _ in delayed(graph, "diloco", 1, period, delay, steps, 7,
                                       still=delay, dim=dim)]
    rng = np.random.default_rng(7)  # the helper's draws: the start, then a step's noise
    rng.normal(size=(graph.n, dim))
    noise = [None] + [rng.normal(size=(graph.n, dim)) for _ in range(steps)]
    assert np.array_equal(moving[period - 1], still[period - 1])  # the first round's models
    landing = period + delay
    progress = -0.1 * sum(noise[s] for s in range(period + 1, landing + 1))
    assert not np.allclose(progress, 0)
    assert np.allclose(moving[landing - 1][:, :-1] - still[landing - 1][:, :-1], progress,
                       rtol=0, atol=1e-12)
