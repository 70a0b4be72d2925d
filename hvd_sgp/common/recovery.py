"""Fault tolerance with ULFM: every way a lost peer shows up becomes one typed error, and the
pieces of the in-place repair that runtime.repair() strings together.

A failure is noticed where an MPI call on one of hvd_sgp's communicators fails with
ERR_PROC_FAILED (the peer died; ULFM's detector or the launcher said so) or ERR_REVOKED
(another survivor noticed first), or where a wait on a peer passes HVD_SGP_TIMEOUT (a frozen
peer). The rank that notices revokes every hvd_sgp communicator, so that every rank blocked on
any of them learns at once, and raises PeerLostError (a HorovodInternalError). Then every
survivor repairs the same way, whatever it was doing: see runtime.repair().

These are the per-process facts and the pieces every layer uses (waits, transports, the
world); starting fault-tolerant mode (its checks, the heartbeat thread, finalize) is
fault_mode.py's, which reads the options table and sets ``status`` at init.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

from hvd_sgp.common import fault_record
from hvd_sgp.common.errors import PeerLostError, SgpError, on_rank
from hvd_sgp.common.mpi import MPI

# The error classes of a lost peer: ERR_IN_STATUS is what Testall reports for them, and some
# collective components report ERR_OTHER. (Taking a stray error for a failure costs a repair
# that finds nobody lost, and training goes on.) Any other class counts too while ULFM reports
# a member of the world failed (``is_failure``).
FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                             MPI.ERR_REVOKED, MPI.ERR_IN_STATUS, MPI.ERR_OTHER})

# Repairs that find nobody lost, one after another: something is taken for a lost peer again
# and again (ranks in different collectives, or a defect), and the job would repair for ever
# between steps that come every few seconds (a chaos run's livelock: 457 such repairs in 10
# minutes). REPAIRS_IN_VAIN in a row, each within HVD_SGP_TIMEOUT + IN_VAIN_SECONDS of the one
# before (a wait past the timeout is what a mismatch of collectives ends in), end the job with
# an error on every survivor (``repaired``, world_repair._rebuild).
REPAIRS_IN_VAIN = 20
IN_VAIN_SECONDS = 60.0


class _Status:
    """Per-process facts of fault tolerance (one instance, ``status``; fault_mode.configure
    sets the first five at init)."""

    def __init__(self) -> None:
        self.enabled = False
        self.timeout = 300.0
        self.repair_seconds = 0.0  # how long a repair may take (fault_mode.repair_seconds)
        self.revoke_all: Callable[[], None] = lambda: None  # the runtime's
        self.lost_peer: Callable[[], bool] = lambda: False  # the runtime's (World.lost_peer)
        self.origin: Optional[int] = None  # this rank's launch rank, once initialized
        self.elastic_depth = 0  # > 0 while hvd.elastic.run runs the training function
        self.repairing: Optional[float] = None  # the deadline of the repair under way
        self.spawning = False  # inside a spawn or a take-in's connect (recovery.spawning)
        self.call_seconds = 0.0  # how long one of the repair's calls may take (fault_mode)
        self.blocked: Optional[tuple] = None  # (call, deadline, bound) of it (blocked_in)
        self.failure_noticed = False  # set when PeerLostError is raised, cleared by a repair
        self.repairs = 0  # completed repairs of the world
        self.in_vain = 0  # repairs in a row that found nobody lost (``repaired``)
        self.in_vain_at = 0.0  # when the latest repair was counted (time.monotonic)
        self.noticed = ""  # what this rank last took for a lost peer (``lost``)
        self.replacement = False  # this process replaced a lost rank (world_grow.arrive)
        self.watchdog: Optional[threading.Thread] = None
        self.stop = threading.Event()


status = _Status()


def enabled() -> bool:
    """Whether this process runs in fault-tolerant mode (HVD_SGP_FAULT_TOLERANT=1)."""
    return status.enabled


# --- noticing a failure -------------------------------------------------------------------
def is_failure(error: BaseException) -> bool:
    """An MPI error that means a lost peer (in fault-tolerant mode): one of FAILURE_CLASSES, or
    any class while ULFM reports a member of the world failed. A nonblocking collective that
    a death cuts short may end in ERR_INTERN (Open MPI 5.0's NBC aborts its schedule on
    ERR_PROC_FAILED: a take-in's MPI_Comm_idup in a chaos run ended so on every survivor, and
    the job with it)."""
    if not (status.enabled and isinstance(error, MPI.Exception)):
        return False
    if error.Get_error_class() in FAILURE_CLASSES:
        return True
    try:
        return status.lost_peer()
    except MPI.Exception:  # (the world is being replaced)
        return False


def lost(message: str) -> PeerLostError:
    """Revoke every hvd_sgp communicator (so every rank learns) and return the error to raise.
    The rank's record keeps what it noticed: where a repair finds nobody lost, the rank that
    noticed first says why."""
    status.failure_noticed = True
    status.noticed = message
    if status.origin is not None:
        fault_record.write(f"noticed {message}", status.origin)
    status.revoke_all()
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
        if not status.enabled:
            raise


def failure_pending() -> bool:
    """A PeerLostError was raised here and no repair has run since (TF's op errors wrap ours)."""
    return status.failure_noticed


# --- who repairs: the training function's caller or the step itself ------------------------
@contextlib.contextmanager
def elastic_scope() -> Iterator[None]:
    """hvd.elastic.run runs the training function inside: failures go up to it as
    HorovodInternalError instead of being repaired inside the optimizer's step."""
    status.elastic_depth += 1
    try:
        yield
    finally:
        status.elastic_depth -= 1


def repairs_in_step() -> bool:
    """Whether an optimizer repairs a failure inside its own step (fault-tolerant mode, no
    hvd.elastic.run around, not on a worker thread): the plain script goes on from the next
    step."""
    return (status.enabled and status.elastic_depth == 0
            and threading.current_thread() not in _workers)


# --- threads that use the world beside the training thread ---------------------------------
_workers: set = set()  # started by worker_thread, until they end


def worker_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread (not started) that communicates on hvd_sgp's communicators beside the
    training thread (join()'s served step). A failure there goes up to the thread that
    started it and is never repaired in place; a repair waits for it to end before the world
    is rebuilt (``end_workers``). Otherwise it may go on into the repaired world, or revoke
    it for a failure of the old one, and every survivor repairs again with nobody lost."""
    def run() -> None:
        try:
            target()
        finally:
            _workers.discard(thread)
    thread = threading.Thread(target=run, name=name, daemon=True)
    _workers.add(thread)
    return thread


def end_workers(deadline: float) -> None:
    """Wait until every worker thread has ended (they end at the revoke that begins a repair:
    their waits fail on it), or raise at ``deadline`` (time.monotonic)."""
    for thread in list(_workers):
        thread.join(max(0.0, deadline - time.monotonic()))
    late = sorted(thread.name for thread in _workers if thread.is_alive())
    if late:
        raise SgpError(on_rank(f"the repair waited for thread(s) {late} to leave the revoked "
                               "world, in vain"))


@contextlib.contextmanager
def repairing(deadline: float) -> Iterator[None]:
    """Around runtime.repair(): the watchdog leaves a repairing rank alone until ``deadline``
    (time.monotonic), then ends it (MPI_Comm_shrink has no deadline of its own)."""
    status.repairing = deadline
    try:
        yield
        status.failure_noticed = False
        status.repairs += 1
    finally:
        status.repairing = None


def repaired(lost_somebody: bool) -> bool:
    """Count a repair of the world (every survivor, alike): True where it is the
    REPAIRS_IN_VAIN-th in a row that found nobody lost, each within HVD_SGP_TIMEOUT +
    IN_VAIN_SECONDS of the one before. The ranks' clocks differ, so the repair's agreement
    decides for all of them (world_repair._rebuild)."""
    now = time.monotonic()
    if lost_somebody or now - status.in_vain_at > status.timeout + IN_VAIN_SECONDS:
        status.in_vain = 0
    status.in_vain_at = now
    status.in_vain += int(not lost_somebody)
    return status.in_vain >= REPAIRS_IN_VAIN


def in_vain_error() -> SgpError:
    """The error every survivor raises once the agreement says the repairs are in vain; the
    count starts again."""
    status.in_vain = 0
    return SgpError(f"the world was repaired {REPAIRS_IN_VAIN} times in a row, each within "
                    f"{status.timeout + IN_VAIN_SECONDS:g} s of the one before, and nobody was "
                    "lost: the ranks keep taking something for a lost peer (this rank last "
                    f"noticed: {status.noticed or 'nothing'}); the job ends rather than repair "
                    "for ever")


@contextlib.contextmanager
def blocked_in(call: str, extra: float = 0.0) -> Iterator[None]:
    """Around one of the repair's own collectives (MPI_Comm_shrink, MPI_Comm_agree): a rank
    still inside it ``status.call_seconds`` (+ ``extra``) later is stuck there, for ULFM's
    detector would have reported any lost peer by then, and fault_mode's guard ends it. A chaos
    run saw one survivor stay in MPI_Comm_shrink while the six others, their shrink done,
    waited for it in the agreement that ends the repair: without this bound every survivor
    would have reached the repair's deadline together, and the job would have been lost. The
    agreement's bound is the longer (``extra``), so that the stuck rank leaves first and the
    waiting ones learn it."""
    seconds = status.call_seconds + extra
    status.blocked = (call, time.monotonic() + seconds, seconds)
    try:
        yield
    finally:
        status.blocked = None


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Around a grow's MPI_Comm_spawn, a take-in's MPI_Comm_connect to warm spares and their
    merges: when a peer of the world is lost meanwhile, Open MPI 5.0's spawn does not return on
    the spawning rank (its connect with the new processes waits for the dead peer), and a
    take-in's connect did not return on any survivor (a chaos run). The watchdog then revokes
    the world at once (the others, wherever they wait, fail and repair) and ends this rank
    after the detector's timeout, so that the others repair without it rather than wait for
    it until the repair's deadline (fault_mode._stuck_under_spawn)."""
    status.spawning = True
    try:
        yield
    finally:
        status.spawning = False


def own_deadline() -> bool:
    """A repair or a grow is under way: it has its own deadline (the watchdog here), so the
    blocking calls it makes are not also timed as ordinary ones."""
    return status.repairing is not None or status.spawning


def repair_deadline() -> float:
    """Seconds a repair may take (fixed at init, see fault_mode.repair_seconds)."""
    return status.repair_seconds


def arrived() -> None:
    """This process replaced a lost rank: at exit it finalizes as a repaired one does."""
    status.replacement = True


def exclude_self(reason: str) -> None:
    """Say why, then leave (see leave)."""
    _last_words(on_rank(reason))
    leave()


def leave_by_plan(reason: str) -> None:
    """Leave the job with status 0 because the world no longer has a place for this rank (its
    host was removed): the others have already formed their world without it. Without
    MPI_Finalize, which would wait for the others' (ULFM reports the exit to nobody who
    still communicates with this rank)."""
    fault_record.write("left", status.origin)
    _last_words(on_rank(f"leaves the job: {reason}"))
    status.stop.set()
    os._exit(0)


def leave() -> None:
    """Leave the job at once, without MPI_Finalize (which would wait for the others): ULFM
    reports this rank as failed and the survivors repair without it. By SIGKILL rather than a
    non-zero exit status: Open MPI 5.0's runtime counts a rank that exits non-zero twice
    towards the job's end, so a few of them end the job under the survivors' feet (sgprun
    reads the 'failed' record instead of the status)."""
    if status.origin is not None:
        fault_record.write("failed", status.origin)
    _last_words()
    os.kill(os.getpid(), signal.SIGKILL)


def _last_words(line: Optional[str] = None) -> None:
    """Print ``line`` on stderr and flush both streams before the process ends; where nobody
    reads them any more (the launcher gone: a broken pipe), end all the same."""
    if line is not None:
        try:
            print(line, file=sys.stderr)
        except OSError:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
