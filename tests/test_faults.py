"""A dead, frozen or diverged peer ends the whole job non-zero within the timeout plus a few
seconds, with an error naming the peer; never a hang. In one process: the repair's fold and
mass ledger for any graph, codec, delay and set of lost nodes (the simulator's ``lose``, the
core's abandon and exact average)."""
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sgp.common.errors import PeerLostError, PeerTimeoutError, SgpValueError
from hvd_sgp.common.node import exact_average, fold_scratch
from hvd_sgp.sim import SimNetwork
from hvd_sgp.sim.faults import ThreadGroup, lose, run_members
from mpi_launch import run_mpi
from test_properties import graphs

TIMEOUT = 4


@pytest.mark.parametrize("fault, expected", [
    ("freeze", ["PeerTimeoutError", "rank 2", "at iteration 5", "stalled"]),
    ("die", []),
    ("nan", ["from rank 2", "NaN"]),
])
def test_faulty_peer_ends_the_job(fault, expected):
    proc = run_mpi(4, "faults_checks.py", fault, env={"HVD_SGP_TIMEOUT": str(TIMEOUT)},
                   timeout=120, check=False)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "finished without noticing" not in output
    for text in expected:
        assert text in output, (text, output[-3000:])
    injected = float(re.search(r"fault injected at ([0-9.]+)", output).group(1))
    print(f"{fault}: every rank gone {ended - injected:.1f} s after the fault")
    assert ended - injected < TIMEOUT + 10, ended - injected


def test_a_duplicate_cut_short_is_never_revoked():
    """process_sets._dup tracks its communicator (revoked with the world when a peer is lost)
    only once it is built: one cut short by a lost peer is half built, and Open MPI 5.0
    segfaults revoking it (mca_pml_ob1_revoke_comm, a 200-failure chaos run). In one process:
    the bookkeeping is the point, not MPI."""
    from hvd_sgp.common import world
    from hvd_sgp.common.errors import PeerLostError
    from hvd_sgp.common.horovod_api import process_sets

    class Duplicate:  # what Idup hands back: the communicator and its request
        def __init__(self, fails: bool):
            self.fails, self.comm = fails, object()

        def Idup(self):
            return self.comm, self

        def Test(self) -> bool:
            if self.fails:
                raise PeerLostError("a peer was lost during the duplicate")
            return True

    cut_short = Duplicate(fails=True)
    with pytest.raises(PeerLostError):
        process_sets._dup(cut_short, timeout=5)
    assert not any(comm is cut_short.comm for comm in world._tracked)
    built = Duplicate(fails=False)
    assert process_sets._dup(built, timeout=5) is built.comm
    assert any(comm is built.comm for comm in world._tracked)
    world.untrack(built.comm)


CODECS = ["none", "int8", "int4", "topk:0.3", "randomk:0.3"]  # (fp16 rounds mass away)


def folded(net: SimNetwork, survivors: list) -> np.ndarray:
    """sum_i(w_i z_i) / sum_i(w_i) over the survivors as they stand (per entry where the
    weights are)."""
    w = net.weights()[survivors]
    w = w if w.ndim == 2 else w[:, None]
    return (w * net.params[survivors]).sum(axis=0) / w.sum(axis=0)


def mixed(graph, delay: int, spec: str, steps: int, seed: int):
    """A network that mixed ``steps`` times from spread-out parameters, with local steps
    between (the numerators move); and the random generator that moved them."""
    rng = np.random.default_rng(seed)
    net = SimNetwork(graph, 4, delay=delay, seed=seed, codec=spec)
    net.params[...] = 1 + rng.normal(size=net.params.shape)
    for _ in range(steps):
        net.params[...] -= 0.1 * rng.normal(size=net.params.shape)
        net.step()
    return net, rng


@settings(max_examples=60, deadline=None)
@given(graph=graphs(), delay=st.integers(0, 3), spec=st.sampled_from(CODECS),
       steps=st.integers(0, 12), data=st.data(), seed=st.integers(0, 2**16))
def test_a_repair_folds_the_survivors_into_their_exact_average_and_counts_nothing_twice(
        graph, delay, spec, steps, data, seed):
    """Nodes mix with local steps between (the numerators move), then some are lost at once
    with messages in flight, to and from anyone; then again, among the survivors (two
    failures in a row). Each time every survivor ends at the survivors' exact weighted average
    as they stood, weight 1, nothing in flight; abandoning twice (a repair that starts over)
    changes nothing; and mixing on among the survivors keeps their mass and average: no
    message of before the loss is ever added."""
    net, rng = mixed(graph, delay, spec, steps, seed)
    for _ in range(2):
        if net.n < 2:
            break
        lost = data.draw(st.sets(st.integers(0, net.n - 1), min_size=1, max_size=net.n - 1))
        survivors = [i for i in range(net.n) if i not in lost]
        for mixer in net.mixers:
            mixer.abandon()
        expected = folded(net, survivors)
        net = lose(net, lost, topology="exponential")
        assert net.n == len(survivors)
        scale = np.abs(expected).max()
        assert np.abs(net.params - expected).max() <= 1e-12 * scale, (net.params, expected)
        assert np.all(net.weights() == 1) and not np.any(net.in_flight()[1])
        for _ in range(int(rng.integers(1, 8))):
            net.step()
            numerators, weight = net.mass()  # nodes plus in flight
            assert np.abs(numerators - net.n * expected).max() <= 1e-9 * net.n * scale
            assert np.abs(weight - net.n).max() <= 1e-9 * net.n
        net.drain()
        assert np.abs(net.average() - expected).max() <= 1e-9 * scale


@settings(max_examples=40, deadline=None)
@given(graph=graphs(), delay=st.integers(0, 3), spec=st.sampled_from(CODECS),
       steps=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2**16))
def test_a_fold_cut_short_by_a_death_leaves_the_state_for_the_next_attempt(
        graph, delay, spec, steps, data, seed):
    """A survivor dies inside the fold's collectives (in the numerators' sum or the weights'):
    the fold raises PeerLostError on every survivor and leaves every buffer as it stood, so the
    repair's next attempt, with that survivor lost too, folds the others' state exactly. (It
    once folded in place: a buffer already multiplied by its weight was folded again.)"""
    net, _ = mixed(graph, delay, spec, steps, seed)
    lost = data.draw(st.sets(st.integers(0, net.n - 1), max_size=net.n - 2))
    survivors = [i for i in range(net.n) if i not in lost]
    victim = data.draw(st.sampled_from(survivors))
    for mixer in net.mixers:
        mixer.abandon()
    stood = net.buffers.copy()
    expected = folded(net, [i for i in survivors if i != victim])
    with pytest.raises(PeerLostError):
        lose(net, lost, dies=(victim, data.draw(st.integers(0, 1))))
    assert np.array_equal(net.buffers, stood)
    net = lose(net, lost | {victim}, topology="exponential")
    assert np.abs(net.params - expected).max() <= 1e-12 * np.abs(expected).max()
    assert np.all(net.weights() == 1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), dim=st.integers(1, 300), per_entry=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_the_fold_in_its_scratch_gives_the_bits_of_the_fold_without(n, dim, per_entry, dtype,
                                                                     seed):
    """The repair's fold takes its copy in memory kept for it (node.fold_scratch, in
    fault-tolerant mode) rather than a new array: the same bits on every member, weight by
    weight or entry by entry, and the scratch used again gives them again."""
    rng = np.random.default_rng(seed)
    start = rng.normal(size=(n, dim + 1)).astype(dtype)
    start[:, -1] = rng.uniform(0.1, 2.0, size=n)
    weights = [rng.uniform(0.1, 2.0, size=dim) if per_entry else None for _ in range(n)]

    def fold(scratch):
        buffers = start.copy()
        run_members(ThreadGroup(n), [lambda comm, r=r: exact_average(
            buffers[r], comm, None, weights[r], None if scratch is None else scratch[r])
            for r in range(n)])
        return buffers
    scratch = fold_scratch(list(start))
    expected = fold(None)
    assert np.array_equal(fold(scratch), expected) and np.array_equal(fold(scratch), expected)


def test_lose_names_what_it_cannot_do():
    net = SimNetwork("ring", 2, n=4)
    with pytest.raises(SgpValueError, match="some, not all"):
        lose(net, {0, 1, 2, 3})
    with pytest.raises(SgpValueError, match="some, not all"):
        lose(net, {4})
    with pytest.raises(SgpValueError, match="node 1, which dies in the fold, is not a survivor"):
        lose(net, {1}, dies=(1, 0))


def test_a_member_that_fails_fails_the_others_collective_instead_of_hanging():
    started = time.monotonic()

    def fails(comm):
        raise RuntimeError(f"member {comm.Get_rank()} failed")

    def sums(comm):
        comm.allreduce(1.0)
    with pytest.raises(RuntimeError, match="member 1 failed"):
        run_members(ThreadGroup(3), [sums, fails, sums])
    assert time.monotonic() - started < 5


def test_a_member_that_never_finishes_is_named_after_the_deadline(monkeypatch):
    from hvd_sgp.sim import faults  # (its deadline, shortened)
    monkeypatch.setattr(faults, "DEADLINE_SECONDS", 0.2)
    with pytest.raises(PeerTimeoutError, match=r"members \[1\] did not finish"):
        run_members(ThreadGroup(2), [lambda comm: None, lambda comm: time.sleep(1.0)])


def test_a_successor_takes_over_the_fold_scratch_that_fits():
    """A successor engine (replacements joined) takes its predecessor's fold scratch where
    length and dtype fit, so its start touches no fresh pages; a buffer of another size or
    dtype gets its own, touched."""
    buffers = [np.ones(11), np.ones(5, np.float32), np.ones(7)]
    first = fold_scratch(buffers)
    assert [a.shape for a in first] == [(10,), (4,), (6,)]
    grown = [np.ones(11), np.ones(5), np.ones(9)]  # same; other dtype; other length
    second = fold_scratch(grown, first)
    assert second[0] is first[0]
    assert second[1] is not first[1] and second[1].dtype == np.float64
    assert second[2].shape == (8,) and not any(second[2] is a for a in first)
    assert fold_scratch(buffers + [np.ones(3)], first)[3].shape == (2,)  # more buffers


def test_a_peer_lost_under_a_spawn_revokes_the_world_once_and_starts_the_clock(monkeypatch):
    """fault_mode._stuck_under_spawn: outside recovery.spawning nothing happens; inside it,
    the first sight of a lost peer revokes the world and starts the clock the watchdog holds
    against the detector's timeout; later sights keep the start; a lost peer that goes away
    (the world replaced) or leaving the spawn stops the clock."""
    from hvd_sgp.common import fault_mode, recovery
    revokes = []
    monkeypatch.setattr(recovery.status, "revoke_all", lambda: revokes.append(1))
    lost = [True]
    assert fault_mode._stuck_under_spawn(None, lambda: lost[0]) is None and not revokes
    with recovery.spawning():
        began = fault_mode._stuck_under_spawn(None, lambda: lost[0])
        assert began is not None and revokes == [1]
        time.sleep(0.01)
        assert fault_mode._stuck_under_spawn(began, lambda: lost[0]) == began
        assert revokes == [1]
        lost[0] = False
        assert fault_mode._stuck_under_spawn(began, lambda: lost[0]) is None
    assert fault_mode._stuck_under_spawn(began, lambda: True) is None


def test_any_mpi_error_is_a_lost_peer_while_ulfm_reports_one(monkeypatch):
    """recovery.is_failure: ERR_INTERN (what a take-in's MPI_Comm_idup cut short by a death
    ended in on every survivor of a chaos run) is a lost peer while ULFM reports a member of
    the world failed, and goes up as itself otherwise; without fault tolerance nothing is."""
    from hvd_sgp.common import recovery
    from hvd_sgp.common.mpi import MPI
    lost = [False]
    monkeypatch.setattr(recovery.status, "enabled", True)
    monkeypatch.setattr(recovery.status, "lost_peer", lambda: lost[0])
    monkeypatch.setattr(recovery.status, "revoke_all", lambda: None)
    monkeypatch.setattr(recovery.status, "failure_noticed", False)
    intern, failed = MPI.Exception(MPI.ERR_INTERN), MPI.Exception(MPI.ERR_PROC_FAILED)
    assert recovery.is_failure(failed) and not recovery.is_failure(intern)
    with pytest.raises(MPI.Exception):
        with recovery.translated("a take-in"):
            raise intern
    lost[0] = True
    assert recovery.is_failure(intern) and not recovery.is_failure(ValueError("x"))
    with pytest.raises(PeerLostError, match="a peer was lost during a take-in"):
        with recovery.translated("a take-in"):
            raise intern

    def freed() -> bool:
        raise MPI.Exception(MPI.ERR_COMM)
    monkeypatch.setattr(recovery.status, "lost_peer", freed)
    assert not recovery.is_failure(intern)
    monkeypatch.setattr(recovery.status, "enabled", False)
    monkeypatch.setattr(recovery.status, "lost_peer", lambda: True)
    assert not recovery.is_failure(intern) and not recovery.is_failure(failed)


def test_repairs_in_vain_are_counted_in_a_row_and_within_the_window(monkeypatch):
    """recovery.repaired: only REPAIRS_IN_VAIN repairs in a row that found nobody lost, each
    within HVD_SGP_TIMEOUT + IN_VAIN_SECONDS of the one before, say the repairs are in vain; a
    repair that lost somebody, or a long enough quiet, starts the count again, and so does the
    error."""
    from hvd_sgp.common import recovery
    now = [1000.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(recovery.status, "in_vain", 0)
    monkeypatch.setattr(recovery.status, "timeout", 30.0)
    monkeypatch.setattr(recovery.status, "noticed", "a peer was lost during the exchange")
    limit, window = recovery.REPAIRS_IN_VAIN, 30.0 + recovery.IN_VAIN_SECONDS

    def repairs(count: int, lost: bool = False, apart: float = 1.0) -> list:
        said = []
        for _ in range(count):
            now[0] += apart
            said.append(recovery.repaired(lost))
        return said
    assert not any(repairs(limit - 1)) and not any(repairs(1, lost=True))
    assert not any(repairs(limit - 1)) and not any(repairs(1, apart=window + 1))
    assert repairs(limit - 1, apart=window) == [False] * (limit - 2) + [True]
    assert "this rank last noticed: a peer was lost during the exchange" in str(
        recovery.in_vain_error())
    assert not any(repairs(limit - 1))


def test_a_world_being_replaced_is_not_taken_for_a_lost_peer():
    """An error from the check (a world freed under the watchdog) is no lost peer."""
    from hvd_sgp.common import fault_mode, recovery

    def freed() -> bool:
        raise RuntimeError("freed")
    with recovery.spawning():
        assert fault_mode._stuck_under_spawn(None, freed) is None


def test_ranks_on_machine_counts_the_entries_here_without_a_communicator(monkeypatch):
    """world.ranks_on_machine (a crowded host's polling, process_sets.start) counts the
    entries whose process runs on this kernel boot; a machine that cannot tell counts by host
    name."""
    from hvd_sgp.common import stopped
    from hvd_sgp.common.world import ranks_on_machine
    me = stopped.identity()
    assert me is not None  # (Linux: /proc/sys/kernel/random/boot_id)
    processes = [me, (me[0], me[1] + 1, me[2]), ("another-boot",) + me[1:], None]
    hosts = ["a", "a", "b", "b"]
    assert ranks_on_machine(processes, hosts, "a") == 2
    monkeypatch.setattr(stopped, "identity", lambda: None)
    assert ranks_on_machine(processes, hosts, "b") == 2
    assert ranks_on_machine(processes, ["a", "b", "b", "b"], "b") == 3


def test_a_rank_stuck_in_one_of_the_repairs_collectives_is_ended_past_its_bound(monkeypatch):
    """fault_mode._check_bounds: inside recovery.blocked_in, nothing before the bound; past
    it, the rank leaves naming the call; the agreement's bound is the longer one (``extra``),
    so a rank stuck in the shrink leaves before those waiting for it in the agreement."""
    from hvd_sgp.common import fault_mode, recovery
    import os
    left = []
    monkeypatch.setattr(recovery, "exclude_self", left.append)
    monkeypatch.setattr(recovery.status, "call_seconds", 0.05)
    with recovery.blocked_in("MPI_Comm_shrink"):
        fault_mode._check_bounds(os.getppid())
        assert not left
        shrink_deadline = recovery.status.blocked[1]
        time.sleep(0.06)
        fault_mode._check_bounds(os.getppid())
    assert len(left) == 1 and left[0].startswith("MPI_Comm_shrink did not return within")
    assert recovery.status.blocked is None
    with recovery.blocked_in("MPI_Comm_agree", extra=1.0):
        assert recovery.status.blocked[1] > shrink_deadline + 1.0
        time.sleep(0.06)
        fault_mode._check_bounds(os.getppid())
        assert len(left) == 1
        recovery.status.blocked = ("MPI_Comm_agree", 0.0, 1.05)  # (the message's bound)
        fault_mode._check_bounds(os.getppid())
    assert left[1].startswith("MPI_Comm_agree did not return within 1 s")
