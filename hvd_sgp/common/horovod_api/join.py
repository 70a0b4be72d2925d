"""``join()``: a rank that has run out of data keeps serving the others until every rank has
joined, as Horovod's; it returns the last rank to join, the same on every rank.

An event loop over the negotiation. ``join()`` sends a join request to the coordinator of
every process set this rank is in, then, until the global set's join is answered:

* it drives every controller: the coordinator counts a joined rank as present for the kinds
  a joined rank can serve (allreduce and reducescatter take its neutral contribution -- zeros
  for Sum and Average, whose divisor stays the full set size; barrier), and answers any
  other kind that involves it with an error on the ranks that called it;
* once it has waited ``SERVE_AFTER_SECONDS`` without the answer, it calls ``serve(poll)``
  on every registered participant (``register_join_participant``), where ``poll()`` is one
  non-blocking pass that serves pending negotiated collectives. Where every rank joins at
  once (even data), the answer comes first and nothing is served: a participant then skips
  what it prepares for serving (the optimizer collects dropped optimizers, 0.1-0.2 s of CPU
  with torch loaded; join() took 0.35-0.9 s at 4-8 ranks on 2 cores, and 4-12 ms after).

Termination, two phases. Phase 1: the coordinator answers the global join once every rank
has joined, after everything else it can answer; everyone learns it from that response.
Phase 2 is the join's data phase: each rank reads every participant's
``started_iteration()`` and posts one non-blocking MAX-allreduce of them; from then on it
starts no new iteration. When it completes, every participant gets ``finish(last, poll)``:
it serves (without local work) up to iteration ``last``, the same on every rank, so a gossip
round that a joined rank started is matched by every other rank.

A participant (the optimizer, later) implements::

    serve(poll) -> bool        # bounded work while this rank is joined; True if it did any
    started_iteration() -> int # iterations this rank has started
    finish(last, poll) -> None # serve up to iteration ``last``, then return

``poll`` may be called as often as wanted while a participant waits on its own messages.
Every rank must register the same number of participants, in the same order (the join
negotiation checks the number).
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

import numpy as np

from hvd_sgp.common.blocking import doing
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.horovod_api import negotiation, process_sets
from hvd_sgp.common.horovod_api.negotiation import JOIN, Handle, Kind, Request
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.waiting import Wait
from hvd_sgp.common.watchdog import roll_call


class JoinParticipant(Protocol):
    def serve(self, poll: Callable[[], None]) -> bool: ...

    def started_iteration(self) -> int: ...

    def finish(self, last: int, poll: Callable[[], None]) -> None: ...


SERVE_AFTER_SECONDS = 0.1  # a peer that trains on waits this long once for a served step

_participants: list = []
_joining = [False]


def register_join_participant(participant: JoinParticipant) -> None:
    """Have ``participant`` served while this rank is joined (see the module doc)."""
    _check_not_joining()
    _participants.append(participant)


def unregister_join_participant(participant: JoinParticipant) -> None:
    _check_not_joining()
    _participants.remove(participant)


def _check_not_joining() -> None:
    if _joining[0]:
        raise SgpValueError("join participants cannot change while join() runs")


def poll() -> None:
    """One non-blocking pass serving pending negotiated collectives (a participant's ``poll``)."""
    negotiation.progress_all()


class _Join(Kind):
    name = JOIN

    def check(self, requests, ctl):
        counts = {r: q.extra[0] for r, q in requests.items()}
        if len(set(counts.values())) > 1:
            return ("ranks registered different numbers of join participants: "
                    f"{ctl.disagreement(counts)}")
        return ""

    def phase(self, op, ctl):
        while op.arrays is None:  # join() fills in the iterations after its last serve()
            yield [], True
        started = op.arrays[0]
        yield ([ctl.comm.Iallreduce(MPI.IN_PLACE, started, op=MPI.MAX)] if started.size
               else []), False
        return op.response.last_joined, started.tolist()


negotiation.register(_Join())


class _Watch:
    """Join's deadline: a joined rank may wait long while the others train, but not while
    nothing moves: no response, no participant work for HVD_SGP_TIMEOUT seconds."""

    def __init__(self, ctl: negotiation.Controller):
        self.ctl = ctl
        self.wait = self._wait()

    def _wait(self) -> Wait:
        settings = self.ctl.settings
        return Wait("join()", self._awaited, settings.timeout, fail=self.ctl.fail,
                    stall=settings.stall_warning)

    def _awaited(self) -> str:
        return self.ctl.missing_joins() or f"the ranks that have not joined ({roll_call()})"

    def check(self, moved: bool) -> None:
        if moved:
            self.wait = self._wait()
        else:
            self.wait.due()


def join(device: int = -1) -> int:
    """Serve the other ranks' collectives until every rank has joined; returns the global
    rank that joined last (the same on every rank). ``device`` is Horovod's device for
    temporary tensors; here contributions are made on the host."""
    process_sets.ensure_started()
    _joining[0] = True
    try:
        return _join()
    finally:
        _joining[0] = False


def _join() -> int:
    with doing("join()"):
        with negotiation.lock():
            ops = [ctl.submit(Request(JOIN, JOIN, extra=(len(_participants) if sid == 0 else 0,)),
                              None)
                   for sid, ctl in sorted(negotiation.controllers.items())]
        main, pause = ops[0], 0.0
        watch = _Watch(negotiation.controllers[0])
        serve_from = time.monotonic() + SERVE_AFTER_SECONDS
        while main.response is None and not main.done:  # phase 1: serve until all joined
            moved = negotiation.progress_all()
            if main.response is None and time.monotonic() >= serve_from:
                moved |= any([bool(p.serve(poll)) for p in _participants])
            watch.check(moved)
            pause = 0.0 if moved else min(max(pause * 2, 5e-5), negotiation.MAX_PAUSE_SECONDS)
            time.sleep(pause)
        for op in ops:  # phase 2: agree on the last iteration (MAX of those started)
            op.arrays = [np.array([p.started_iteration() for p in _participants]
                                  if op is main else [], np.int64)]
        last, agreed = Handle(main).wait()
        for op in ops[1:]:
            Handle(op).wait()
        for participant, iteration in zip(_participants, agreed):
            participant.finish(int(iteration), poll)
        return int(last)
