"""Blocking MPI calls under a deadline: the watchdog thread and the watched communicators.

The hot path's collectives (the in-node gradient sum, exact averages, gathers) stay blocking
MPI calls: libnbc's non-blocking versions measured 1.4-2.3x slower. Instead, every blocking
collective on a communicator that hvd_sgp derives from its world (``blocking.watched``) records
what it is doing, and one thread per process checks those records against ``HVD_SGP_TIMEOUT``
(``waiting``'s policy, applied from outside the blocked thread; a call outside any step of an
optimizer, at start-up say, waits at least START_SECONDS, as ranks import frameworks and load
data at different speeds):

- past the stall point it warns, naming the call, the iteration and the ranks that are not in
  it (found by a roll call, below);
- past the deadline, in fault-tolerant mode, it revokes the communicators: the blocked call
  returns ERR_REVOKED, which becomes PeerLostError and a repair on the blocked thread;
- otherwise it ends the job: it tells every rank why (so every rank's log names the late
  ones), prints it and exits non-zero, and mpirun ends the rest. A Python exception cannot be
  raised into a thread blocked inside MPI.

The roll call: the waiting rank asks every rank of the world, on a private communicator, what
it is doing; each rank's watchdog answers from its records. A rank that does not answer within
ROLL_CALL_SECONDS is frozen, dead or ended; one that answers names the call it blocks in (or
none: it computes, or waits elsewhere), so ranks at different iterations show up as such.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any, NamedTuple, Optional

from hvd_sgp.common import blocking, recovery, waiting
from hvd_sgp.common.errors import on_rank
from hvd_sgp.common.mpi import MPI

START_SECONDS = 60.0  # the least a call outside any step waits: ranks start at different speeds
TICK_SECONDS = 0.1  # how often the thread checks deadlines and answers roll calls
ROLL_CALL_SECONDS = 2.0  # how long a roll call waits for answers
FRESH_SECONDS = 2 * ROLL_CALL_SECONDS  # a roll call this recent answers the next one
_ASK, _ANSWER, _VERDICT = 1, 2, 3  # tags on the roll-call communicator
_OUTSIDE = "a collective outside any step"  # what a call not under ``doing`` is


class _Watch:
    """The thread that watches this process's blocking calls (blocking.py), and the roll call."""

    def __init__(self) -> None:
        self.timeout = 300.0
        self.roll: Optional[MPI.Comm] = None  # the roll call's communicator (world-sized)
        self.group: Optional[MPI.Group] = None  # the world's, to name a communicator's ranks
        self.names: list = []  # world rank -> how errors name it (its launch rank)
        self.rank = 0  # this one's, in the world
        self.said: tuple = (-FRESH_SECONDS, "")  # (when, what) of the last roll call
        self.sends: list = []  # roll-call messages still in flight
        self.lock = threading.RLock()  # one thread at a time on the roll call's communicator
        self.thread: Optional[threading.Thread] = None
        self.stop = threading.Event()


_watch = _Watch()


# --- the thread ------------------------------------------------------------------------------
def start(world: MPI.Comm, names: list, timeout: float, threads: bool) -> None:
    """At init (collective over ``world``): the roll call's communicator and the thread.
    Without MPI_THREAD_MULTIPLE there is no roll call: the deadline alone."""
    _watch.timeout = timeout
    _watch.names, _watch.group, _watch.rank = list(names), world.Get_group(), world.Get_rank()
    if threads and not recovery.enabled():  # (under ULFM a lost rank is repaired instead)
        _watch.roll = world.Dup()
        waiting.others[0] = roll_call
    if _watch.thread is None:
        _watch.stop.clear()
        _watch.thread = threading.Thread(target=_run, name="hvd_sgp-watchdog", daemon=True)
        _watch.thread.start()
        atexit.register(stop)


def set_timeout(timeout: float) -> None:
    """The deadline of blocking calls (an optimizer's ``timeout`` option, HVD_SGP_TIMEOUT)."""
    _watch.timeout = float(timeout)


def stop() -> None:
    """Before MPI_Finalize (atexit) or shutdown: end the thread, free the roll call's
    communicator."""
    _watch.stop.set()
    if _watch.thread is not None:
        _watch.thread.join(timeout=2 * TICK_SECONDS + ROLL_CALL_SECONDS)
        _watch.thread = None
    roll, _watch.roll = _watch.roll, None
    waiting.others[0] = waiting.others_default
    if roll is not None:
        recovery.free(roll)


def _run() -> None:
    while not _watch.stop.wait(TICK_SECONDS):
        try:
            with _watch.lock:
                _serve(answers=True)
            if recovery.own_deadline():
                continue
            for key, call in list(blocking.calls.items()):
                _check(key, call)
        except MPI.Exception:  # noqa: PERF203  (a communicator freed under us at shutdown)
            if _watch.stop.is_set():
                return
            raise


def _check(key: int, call: list) -> None:
    began, comm, name, warned = call
    waited = time.monotonic() - began
    activity = blocking.activity.get(key)
    timeout = _watch.timeout if activity is not None else max(_watch.timeout, START_SECONDS)
    if waited < waiting.STALL_FRACTION * timeout or (warned and waited < timeout):
        return
    what, iteration, _, _ = activity or (_OUTSIDE, None, 0.0, None)
    place = waiting.place(f"{what}, MPI_{name}", iteration)
    if waited < timeout:
        call[3] = True
        waiting.stall_warning(f"stalled {waited:.0f} s {place} over {_members(comm)}; "
                              f"{roll_call()}; the job fails after {timeout:.0f} s")
        return
    if recovery.enabled():
        blocking.calls.pop(key, None)
        recovery.lost(f"waited {timeout:.0f} s {place} (HVD_SGP_TIMEOUT)")
        return
    _end_job(f"waited {timeout:.0f} s {place} over {_members(comm)}: {roll_call()} "
             "(HVD_SGP_TIMEOUT); the job ends")


def _members(comm: MPI.Comm) -> str:
    names = names_in(comm)
    return "its ranks" if names is None else _ranks(names)


def names_in(comm: MPI.Comm) -> Optional[list]:
    """The names (launch ranks) of ``comm``'s members, in its order; None where some are not
    of the world the watchdog started with (spawned replacements)."""
    try:
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          _watch.group)
    except MPI.Exception:
        return None
    if any(r == MPI.UNDEFINED for r in ranks):
        return None
    return [name_of(r) for r in ranks]


def name_of(world_rank: int) -> Any:
    """How errors name a rank of the world (its launch rank)."""
    return _watch.names[world_rank] if 0 <= world_rank < len(_watch.names) else world_rank


# --- the roll call ---------------------------------------------------------------------------
class Status(NamedTuple):
    """What a rank is doing, as its watchdog answers a roll call."""

    what: str
    call: Optional[str]  # the blocking MPI call it is in, if any
    iteration: Optional[int]  # inside an optimizer's step: which
    seconds: float  # how long it has been at it
    owner: Optional[int]  # the engine whose step it is in (``doing``'s owner)

    def __str__(self) -> str:
        what = f"{self.what} (MPI_{self.call})" if self.call else self.what
        at = f" at iteration {self.iteration}" if self.iteration is not None else ""
        return f"in {what}{at} for {self.seconds:.0f} s"


def _status() -> Optional[Status]:
    """What this rank is doing, for another rank's roll call (None: it computes)."""
    now = time.monotonic()
    calls = list(blocking.calls.items())
    if calls:
        key, (began, _, name, _) = calls[0]
        what, iteration, _, owner = blocking.activity.get(key, (_OUTSIDE, None, 0.0, None))
        return Status(what, name, iteration, now - began, owner)
    activities = list(blocking.activity.values())
    if not activities:
        return None
    what, iteration, began, owner = activities[0]
    return Status(what, None, iteration, now - began, owner)


def _serve(answers: bool) -> None:
    """Answer the roll calls of others and take their verdicts; drop late answers to an
    earlier roll call of ours (``answers``; not while one is under way: its receives take
    them)."""
    roll = _watch.roll
    if roll is None:
        return
    status = MPI.Status()
    for tag in (_ASK, _VERDICT) + ((_ANSWER,) if answers else ()):
        while roll.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            source = status.Get_source()
            message = roll.recv(source=source, tag=tag)
            if tag == _ASK:
                _watch.sends.append(roll.isend(_status(), dest=source, tag=_ANSWER))
            elif tag == _VERDICT:
                _say_and_exit(f"the job ends: rank {name_of(source)} {message}")
    _watch.sends = [r for r in _watch.sends if not r.Test()]


SILENT = "silent"  # a rank that did not answer the roll call


def in_words(answer: Any) -> str:
    """A roll-call answer (``ask``) in words."""
    if isinstance(answer, Status):
        return str(answer)
    return "in no blocking call" if answer is None else "does not answer"


def roll_call() -> str:
    """Ask every other rank what it does (the answers of a watchdog thread, which take up to
    ROLL_CALL_SECONDS when some do not come); 'rank 3 does not answer (frozen, dead or ended);
    ranks 1, 2 are in the gradient sum (MPI_Allreduce) at iteration 5 for 4 s'. One taken
    within FRESH_SECONDS answers again: a stall warning shortly before its deadline (a short
    HVD_SGP_TIMEOUT) would otherwise delay the error by a second roll call."""
    when, said = _watch.said
    if time.monotonic() - when < FRESH_SECONDS:
        return said
    answers = ask()
    if answers is None:  # (fault-tolerant mode, or no MPI_THREAD_MULTIPLE)
        return "the other ranks were not asked"
    me = name_of(_watch.rank)
    by_status: dict[str, list] = {}
    for rank, answer in answers.items():
        if rank != me:
            by_status.setdefault(in_words(answer), []).append(rank)
    silent = by_status.pop(in_words(SILENT), None)
    parts = ([f"{_ranks(silent)} {'does' if len(silent) == 1 else 'do'} not answer "
              "(frozen, dead or ended)"] if silent else [])
    parts += [f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} {status}"
              for status, ranks in by_status.items()]
    _watch.said = (time.monotonic(), "; ".join(parts) or "no other rank")
    return _watch.said[1]


def ask() -> Optional[dict]:
    """The roll call itself: every rank's ``Status`` by its name (launch rank), this one's
    included; None for a rank that computes, SILENT for one that did not answer within
    ROLL_CALL_SECONDS. None where there is no roll call (fault-tolerant mode, or no
    MPI_THREAD_MULTIPLE)."""
    with _watch.lock:
        roll = _watch.roll
        if roll is None:
            return None
        me = roll.Get_rank()
        others = [r for r in range(roll.Get_size()) if r != me]
        requests = [roll.irecv(source=r, tag=_ANSWER) for r in others]
        for r in others:
            _watch.sends.append(roll.isend(None, dest=r, tag=_ASK))
        answers: dict[int, Any] = {me: _status()}
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while len(answers) <= len(others) and time.monotonic() < deadline:
            for r, request in zip(others, requests):
                if r not in answers:
                    done, message = request.test()
                    if done:
                        answers[r] = message
            _serve(answers=False)  # the others may be calling the roll at the same time
            time.sleep(0.01)
        for r, request in zip(others, requests):
            if r not in answers:
                request.Cancel()
        return {name_of(r): answers.get(r, SILENT) for r in range(roll.Get_size())}


def _ranks(ranks: list) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def announce(message: str) -> None:
    """Tell every other rank why the job ends: their watchdogs print it and exit. (Before this
    rank ends the job; a no-op without the roll call's communicator.)"""
    roll = _watch.roll
    if roll is None:
        return
    me = roll.Get_rank()
    try:
        with _watch.lock:
            for r in range(roll.Get_size()):
                if r != me:
                    _watch.sends.append(roll.isend(message, dest=r, tag=_VERDICT))
    except MPI.Exception:
        return
    time.sleep(0.5)  # let the verdicts leave before this process does


def _end_job(message: str) -> None:
    """Announce, print and exit non-zero; mpirun then ends whatever is left."""
    announce(message)
    _say_and_exit(message)


def _say_and_exit(message: str) -> None:
    print(on_rank(message), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
