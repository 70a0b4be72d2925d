"""Overlap SGP and schedules in the core, on real MPI processes (run by test_overlap.py).

argv: STEPS MAX_DELAYS (comma-separated). Every rank sleeps a random time each step, so messages really arrive late.
"""
import sys
import time

import numpy as np
from hvd_sgp.common.mpi import MPI

from hvd_sgp.common import allocate, init, make_topology, runtime
from hvd_sgp.common.overlap import OverlapMixer
from hvd_sgp.common.pushsum import Audit
from hvd_sgp.common.transport import PeerTransport, Progress
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
    and after each release() the buffer is written (as a local step would) with a change whose
    mass is booked: a push still reading the buffer then would carry mass nobody booked (its
    model is past MPI's eager limit, so the receiver reads the buffer after the send began)."""
    size = 100_000 if in_place else 50
    buf = allocate(size, np.float64)
    buf[:-1] = rng.normal(size=size)
    mixer = OverlapMixer(buf, make_topology("exponential", n), transport, progress,
                         max_delay=tau, in_place=in_place)
    assert mixer.in_place == (in_place and tau == 1)
    mixer.audit = Audit()
    start = mass(buf, mixer)
    booked = np.zeros(2)  # mass this rank's local steps added
    worst = 0.0
    for k in range(steps):
        time.sleep(rng.uniform(0, 2e-4))
        if in_place:
            mixer.release()
            change = rng.normal(scale=1e-3, size=size)
            buf[:-1] += change
            booked[0] += float(buf[-1]) * change.sum()
        mixer.mix()
        assert len(mixer.in_flight) <= tau, len(mixer.in_flight)  # memory stays bounded
        if k % 250 == 0 or k == steps - 1:
            now = mass(buf, mixer) - comm.allreduce(booked)
            worst = max(worst, np.abs(now - start).max() / np.abs(start).max())
    assert worst < 1e-12, worst
    slots = len(mixer._slots) + len(mixer._free)
    assert slots <= tau + 1, slots  # the ring never grew past tau + 1 message copies
    if mixer.in_place:  # the slots hold receive rows only: no copy of the model is sent
        assert all(not slot.sends for slot in list(mixer._slots.values()) + mixer._free)
    mixer.drain()
    comm.Barrier()
    mixer.drain()  # nothing left after everyone drained: the ledger closes
    settled = comm.allreduce(np.array([float((buf[:-1] * buf[-1]).sum()), float(buf[-1])]))
    settled -= comm.allreduce(booked)
    assert np.abs(settled - start).max() <= 1e-12 * np.abs(start).max(), (settled, start)
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
        mixer = OverlapMixer(buf, make_topology("exponential", n), transport, progress,
                             push_sum=push_sum, max_delay=tau)
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


@checks
def check_conservation_and_no_deadlock():
    for tau in delays:
        conservation_and_no_deadlock(tau)
    conservation_and_no_deadlock(1, in_place=True)


@checks
def check_debias_matters():
    debias_matters(delays[0])


checks.run(argv=[])  # the command line carries STEPS and MAX_DELAYS
progress.close()
