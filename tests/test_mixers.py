"""Mixers composed of a codec part and a timing part (mixers.build), in one process: which
parts a buffer gets, the guards on composing them by hand, and Overlap SGP's copy-free push
at tau = 1 taking the copying push's steps exactly, in the simulator."""
import numpy as np
import pytest

from hvd_sgp.common.choco import ChocoMixer
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.mixers import build
from hvd_sgp.common.overlap import Overlap
from hvd_sgp.common.pushsum import PushSumMixer, absorb, allocate
from hvd_sgp.common.sparse import SparseMixer
from hvd_sgp.common.timing import Synchronous
from hvd_sgp.common.topology import CustomGraph, make_topology
from hvd_sgp.sim.network import Mailbox, SimNetwork, SimProgress, SimTransport

from due_only import DueOnly


def irregular(n):
    """Column stochastic, not doubly: the weights move even synchronously."""
    return CustomGraph(n, [[[j for j in range(n) if j != i] if i == 0 else [(i + 1) % n]
                            for i in range(n)]])


@pytest.mark.parametrize("spec, kind, in_place", [
    ("none", PushSumMixer, True), ("fp16", PushSumMixer, False), ("int8", ChocoMixer, False),
    ("topk:0.1", ChocoMixer, False), ("randomk:0.25", SparseMixer, False)])
@pytest.mark.parametrize("delay", [0, 1, 2])
def test_build_picks_the_codec_part_and_the_timing_part(spec, kind, in_place, delay):
    mailbox = Mailbox(delay)
    progress = SimProgress(mailbox) if delay else None
    mixer = build(allocate(100, np.float64), make_topology("exponential", 4),
                  SimTransport(mailbox, 0, 4), codec=spec, progress=progress, max_delay=delay,
                  in_place=True)
    assert type(mixer) is kind
    assert type(mixer.timing) is (Overlap if delay else Synchronous)
    assert mixer.overlapped == bool(delay) and mixer.timing.max_delay == delay
    # the copy-free push: uncompressed PushSum at tau = 1 only
    assert getattr(mixer.timing, "in_place", False) == (in_place and delay == 1)
    assert mixer.ordered == (kind is ChocoMixer)  # CHOCO's differences apply in send order
    # weights move under Overlap SGP: tracked (random-k: per run) only there on this graph
    moving = mixer.run_weights is not None if kind is SparseMixer else mixer.track_weight
    assert moving == bool(delay)


def test_composing_by_hand_is_checked():
    mailbox = Mailbox(1)
    topology = make_topology("exponential", 4)
    timing = Overlap(SimProgress(mailbox))
    PushSumMixer(allocate(10), topology, SimTransport(mailbox, 0, 4), timing=timing)
    with pytest.raises(SgpValueError, match="one timing object per mixer"):
        PushSumMixer(allocate(10), topology, SimTransport(mailbox, 1, 4), timing=timing)
    with pytest.raises(SgpValueError, match="untracked"):
        PushSumMixer(allocate(10), topology, SimTransport(mailbox, 1, 4), track_weight=False,
                     timing=Overlap(SimProgress(mailbox)))
    with pytest.raises(SgpValueError, match="max_delay must be >= 1"):
        Overlap(SimProgress(mailbox), max_delay=0)


def trajectory(topology, in_place, n=8, dim=64, steps=40):
    """Local steps pulling each node to its own target between Overlap SGP (tau = 1)
    iterations, every node summing in only the messages due; what each local step starts
    from, and the end after a drain."""
    net = SimNetwork(topology, dim, n=n, delay=1)
    net.mixers[:] = [PushSumMixer(net.buffers[i], net.topology, mixer.transport,
                                  timing=DueOnly(net.progress, 1, in_place))
                     for i, mixer in enumerate(net.mixers)]
    assert net.mixers[0].timing.in_place == in_place
    rng = np.random.default_rng(1)
    net.params[...] = rng.normal(size=net.params.shape)
    target = rng.normal(size=net.params.shape)
    seen = []
    for _ in range(steps):
        absorb(net.mixers)  # as the engine's begin_step does
        seen.append(net.buffers.copy())
        net.params[...] -= 0.1 * (net.params - target) + 0.01 * rng.normal(size=net.params.shape)
        net.step()
    copies = sum(len(slot.sends) for m in net.mixers
                 for slot in list(m.timing._slots.values()) + m.timing._free)
    net.drain()
    seen.append(net.buffers.copy())
    return np.array(seen), copies


@pytest.mark.parametrize("graph", ["exponential", "irregular"])
def test_in_place_push_takes_the_copying_push_steps_exactly(graph):
    """tau = 1's push reads the buffer itself; with the same messages summed in, it takes the
    copying push's steps bit for bit (tests/overlap_checks.py: the same over MPI, where
    arrival times vary)."""
    topology = irregular(8) if graph == "irregular" else graph
    copied, copies = trajectory(topology, in_place=False)
    placed, none = trajectory(topology, in_place=True)
    assert copies > 0 and none == 0  # the in-place path really sent no copy
    assert np.array_equal(placed, copied), np.abs(placed - copied).max()


def _poison(slot) -> None:
    """Every byte of a slot's storage 0xFF (NaN in floats): a step reading what it did not
    write this iteration shows."""
    for array in list(slot.sends.values()) + list(slot.rows.values()):
        array.view(np.uint8).fill(0xFF)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "topk:0.1", "randomk:0.25"])
@pytest.mark.parametrize("delay", [0, 1, 2])
def test_mixers_built_again_take_the_same_steps_on_the_storage_they_take_over(spec, delay):
    """A repair, a restore or replacements joining build new mixers, which take over the old
    ones' message storage (pushsum.Slot: the first exchange after one then touches no fresh
    pages). Poisoned, that storage gives the steps that fresh storage gives, bit for bit."""
    def run(reuse: bool):
        net = SimNetwork("exponential", 48, n=6, delay=delay, codec=spec, seed=3)
        rng = np.random.default_rng(1)
        net.params[...] = rng.normal(size=net.params.shape)
        target = rng.normal(size=net.params.shape)

        def train(steps: int) -> None:
            for _ in range(steps):
                net.params[...] -= 0.1 * (net.params - target)
                net.step()
            net.drain()
        train(5)
        old = [mixer.slot for mixer in net.mixers]
        assert all(slot.rows for slot in old)  # (something to take over)
        for slot in old:
            _poison(slot)
        net.mixers[:] = [build(net.buffers[i], net.topology, mixer.transport, codec=spec,
                               progress=net.progress, max_delay=delay,
                               slot=old[i] if reuse else None)
                         for i, mixer in enumerate(net.mixers)]
        taken = [mixer.slot is slot for mixer, slot in zip(net.mixers, old)]
        train(8)
        return net.buffers.copy(), taken
    fresh, none_taken = run(reuse=False)
    reused, taken = run(reuse=True)
    assert all(taken) and not any(none_taken)
    assert np.isfinite(fresh).all()
    assert np.array_equal(reused, fresh), np.abs(reused - fresh).max()


def test_storage_serves_only_buffers_of_its_kind():
    """A slot is taken over by a buffer of its kit and dtype only; another gets new storage."""
    mailbox = Mailbox(0)
    topology = make_topology("exponential", 4)
    first = PushSumMixer(allocate(10), topology, SimTransport(mailbox, 0, 4))
    same = PushSumMixer(allocate(20), topology, SimTransport(mailbox, 0, 4), slot=first.slot)
    other = PushSumMixer(allocate(10, np.float64), topology, SimTransport(mailbox, 0, 4),
                         slot=first.slot)
    assert same.slot is first.slot and other.slot is not first.slot
