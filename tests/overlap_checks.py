"""Overlap SGP and schedules in the core, on real MPI processes (run by test_overlap.py).

argv: STEPS MAX_DELAYS (comma-separated) [CHECKS...]. Every rank sleeps a random time each step,
so messages really arrive late.
"""
import sys
import time

import numpy as np
from hvd_sgp.common.mpi import MPI

from hvd_sgp.common import allocate, init, make_topology, runtime
from hvd_sgp.common.overlap import Overlap
from hvd_sgp.common.pushsum import Audit, PushSumMixer
from hvd_sgp.common.transport import PeerTransport, Progress
from due_only import DueOnly
from mpi_checks import Checks

init()
comm = runtime.world_comm()
n, me = comm.Get_size(), comm.Get_rank()
steps, delays = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
rng = np.random.default_rng(1000 + me)
transport = PeerTransport(comm)
progress = Progress(transport)


checks = Checks("overlap", comm.Get_rank, comm.Get_size, comm.Barrier)


def mass(buf, mixer):
    """Network numerator and weight, plus what is in flight (sent, not yet summed in)."""
    w = float(buf[-1])
    local = np.array([float((buf[:-1] * w).sum()), w]) + mixer.audit.sent - mixer.audit.received
    return comm.allreduce(local)


def conservation_and_no_deadlock(tau, in_place=False):
    """Mass plus what is in flight is conserved. ``in_place``: pushes read the buffer itself,
    and after each absorb() the buffer is written (as a local step would) with a change whose
    mass is booked: a push still reading the buffer then would carry mass nobody booked (its
    model, 160 kB as trajectory()'s, is past MPI's eager limits (TCP 64 kB, shared memory
    4 kB), so the receiver reads the buffer after the send began)."""
    size = 20_000 if in_place else 50
    buf = allocate(size, np.float64)
    buf[:-1] = rng.normal(size=size)
    timing = Overlap(progress, max_delay=tau, in_place=in_place)
    mixer = PushSumMixer(buf, make_topology("exponential", n), transport, timing=timing)
    assert timing.in_place == (in_place and tau == 1)
    mixer.audit = Audit()
    start = mass(buf, mixer)
    # Rounding error scales with the sum of magnitudes, not with the (cancelling) sum itself;
    # one push of unbooked mass is off by ~1e-6 of it, six orders above the 1e-12 asked.
    scale = np.array([comm.allreduce(float(np.abs(buf[:-1]).sum() * buf[-1])), start[1]])
    booked = np.zeros(2)  # mass this rank's local steps added
    worst = 0.0
    for k in range(steps):
        time.sleep(rng.uniform(0, 2e-4))
        if in_place:
            mixer.absorb()
            assert len(mixer.in_flight) <= tau, len(mixer.in_flight)
            change = rng.normal(scale=1e-3, size=size)
            buf[:-1] += change
            booked[0] += float(buf[-1]) * change.sum()
        mixer.mix()  # memory stays bounded (in place, the last receives wait for absorb())
        assert len(mixer.in_flight) <= tau + timing.in_place, len(mixer.in_flight)
        if k % 250 == 0 or k == steps - 1:
            now = mass(buf, mixer) - comm.allreduce(booked)
            worst = max(worst, (np.abs(now - start) / scale).max())
    assert worst < 1e-12, worst
    slots = len(timing._slots) + len(timing._free)
    assert slots <= tau + 1, slots  # the ring never grew past tau + 1 message copies
    if timing.in_place:  # the slots hold receive rows only: no copy of the model is sent
        assert all(not slot.sends for slot in list(timing._slots.values()) + timing._free)
    mixer.drain()
    comm.Barrier()
    mixer.drain()  # nothing left after everyone drained: the ledger closes
    settled = comm.allreduce(np.array([float((buf[:-1] * buf[-1]).sum()), float(buf[-1])]))
    settled -= comm.allreduce(booked)
    assert (np.abs(settled - start) / scale).max() <= 1e-12, (settled, start)
    truth = (start[0] + comm.allreduce(booked)[0]) / n / size
    spread = comm.allreduce(float(np.abs(buf[:-1].mean() - truth)), op=MPI.MAX)
    place = ", pushes in place" if in_place else ""
    checks.ok(f"overlap tau={tau}{place}: mass + in flight conserved ({worst:.1e}) over {steps} steps "
       f"with random delays, no deadlock, {slots} message slots; consensus error {spread:.1e}")


def debias_matters(tau):
    if n < 2:
        return
    errors = {}
    for push_sum in (True, False):
        buf = allocate(20, np.float64)
        buf[:-1] = float(me)
        truth = (n - 1) / 2
        mixer = PushSumMixer(buf, make_topology("exponential", n), transport,
                             push_sum=push_sum, timing=Overlap(progress, max_delay=tau))
        r = np.random.default_rng(7 + me)
        for _ in range(200):
            time.sleep(r.uniform(0, 3e-4) * (1 + me % 2))
            mixer.mix()
        errors[push_sum] = comm.allreduce(float(np.abs(buf[:-1] - truth).max()), op=MPI.MAX)
        mixer.drain()
        comm.Barrier()
    assert errors[True] < errors[False], errors
    checks.ok(f"overlap de-bias: consensus error {errors[True]:.1e} with the weight, "
       f"{errors[False]:.1e} without")


def trajectory(tau, in_place, steps=60, size=20_000):
    """Local steps (a gradient pulling each rank to its own target, plus seeded noise) between
    Overlap SGP iterations; the parameters and weight each local step starts from, and the end
    after a drain. The model is past MPI's eager limit: in place, a push is read while it runs."""
    r = np.random.default_rng(50 + me)
    target = r.normal(size=size)
    buf = allocate(size, np.float64)
    buf[:-1] = r.normal(size=size)
    timing = DueOnly(progress, max_delay=tau, in_place=in_place)
    mixer = PushSumMixer(buf, make_topology("exponential", n), transport, timing=timing)
    seen = []
    for _ in range(steps):
        time.sleep(r.uniform(0, 2e-4))
        mixer.absorb()  # as the engine's begin_step does
        seen.append(buf.copy())
        buf[:-1] -= 0.1 * (buf[:-1] - target) + 0.01 * r.normal(size=size)
        mixer.mix()
    copies = sum(len(slot.sends) for slot in list(timing._slots.values()) + timing._free)
    mixer.drain()
    comm.Barrier()
    seen.append(buf.copy())
    return np.array(seen), timing.in_place, copies


def in_place_push_matches_copy(tau):
    """A push that reads the buffer in place carries what a copy of it carried: from the same
    start, with the same messages summed, both paths take the same steps to float rounding."""
    copied, _, _ = trajectory(tau, False)
    placed, in_place, copies = trajectory(tau, True)
    assert in_place == (tau == 1) and (copies == 0) == in_place, (in_place, copies)
    scale = np.abs(copied).max()
    gaps = np.abs(placed - copied).max(axis=1) / scale
    first = int(np.argmax(gaps > 1e-12)) if (gaps > 1e-12).any() else None
    worst = comm.allreduce(float(gaps.max()), op=MPI.MAX)
    assert worst <= 1e-12, f"rank {me}: trajectories part at local step {first} ({gaps.max():.1e})"
    place = "in place" if in_place else "in_place ignored (copies)"
    checks.ok(f"overlap tau={tau}: pushes {place} take the copying path's steps over "
              f"{len(gaps) - 1} local steps (largest gap {worst:.1e})")


@checks
def check_in_place_push_matches_copy():
    for tau in delays:
        in_place_push_matches_copy(tau)


@checks
def check_conservation_and_no_deadlock():
    for tau in delays:
        conservation_and_no_deadlock(tau)
    conservation_and_no_deadlock(1, in_place=True)


@checks
def check_debias_matters():
    debias_matters(delays[0])


checks.run(argv=sys.argv[3:])  # after STEPS and MAX_DELAYS
progress.close()
