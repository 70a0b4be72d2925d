"""The one seam for waiting on other ranks: a deadline, who is awaited, a stall warning, and
one policy for the outcome.

Every place a rank waits on another goes through a ``Wait``: polling loops on non-blocking
requests (the gossip transport, the engine's re-sync and finish, process-set start-up) call
``Wait.until``; the negotiated Horovod collectives and join ask ``Wait.due`` from their
controller's loop; blocking MPI calls run under the watchdog (watchdog.py), which applies the
same deadline and policy from its own thread. The outcome, when the deadline passes:

- fault-tolerant mode (ULFM): the late rank is declared lost; every hvd_sgp communicator is
  revoked and PeerLostError is raised, which the survivors repair (recovery.py);
- otherwise: an error naming what waited, at which iteration, and for whom (by default
  PeerTimeoutError; the Horovod-API layer raises its CollectiveTimeoutError).

The stall warning comes first, after ``STALL_FRACTION`` of the timeout, as Horovod's stall
check does.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, NoReturn, Optional

from hvd_sgp.common import recovery
from hvd_sgp.common.errors import PeerTimeoutError, on_rank

STALL_FRACTION = 0.2
MAX_PAUSE = 5e-4  # the longest sleep between two polls of a request
PROBE_SECONDS = 1.0  # how often a wait with a probe runs it


def expire(message: str, error: type = PeerTimeoutError) -> NoReturn:
    """The outcome policy: under ULFM a late rank is a lost one (the survivors repair);
    otherwise ``error`` names it."""
    if recovery.enabled():
        raise recovery.lost(f"{message}: declared failed")
    raise error(message)


def others_default() -> str:
    return ""


# Who else is late, asked of every rank when a wait stalls or expires: the watchdog's roll call
# (watchdog.py installs it at init; without it, nothing more is said).
others: list = [others_default]


def _with_others(message: str) -> str:
    if recovery.enabled():  # (the survivors repair at once: nobody is asked)
        return message
    said = others[0]()
    return f"{message}; {said}" if said else message


def place(what: str, iteration: Optional[int]) -> str:
    """Where a rank waits: 'at iteration 5 (the exchange)', or 'in join()' outside a step."""
    return f"at iteration {iteration} ({what})" if iteration is not None else f"in {what}"


def stall_warning(message: str) -> None:
    print(on_rank(message), file=sys.stderr, flush=True)



class Wait:
    """One wait on other ranks. ``awaited()`` names who has not delivered yet (asked only when
    a warning or an error is due); ``fail`` is the outcome policy (``expire`` by default,
    raising ``error``); ``hint`` ends the timeout's message; ``stall``: seconds before the
    stall warning (None: none; by default STALL_FRACTION of the timeout); ``text(kind,
    waited)``, kind 'stall' or 'timeout', replaces both messages (the Horovod layer's);
    ``probe``: run every PROBE_SECONDS while ``until`` waits, it may raise to end the wait
    early (a wait that can tell it will never end, as the agreement on the iteration can)."""

    def __init__(self, what: str, awaited: Callable[[], str], timeout: float,
                 iteration: Optional[int] = None, error: type = PeerTimeoutError,
                 fail: Optional[Callable[[str], None]] = None,
                 hint: str = "(dead or frozen peer, or ranks running different steps); raise "
                             "HVD_SGP_TIMEOUT if this is a slow start",
                 began: Optional[float] = None, stall: Optional[float] = -1.0,
                 text: Optional[Callable[[str, float], str]] = None,
                 probe: Optional[Callable[[], None]] = None):
        self.what, self.awaited, self.timeout = what, awaited, timeout
        self.iteration, self.error, self.fail, self.hint = iteration, error, fail, hint
        self.began = time.monotonic() if began is None else began
        self.stall = STALL_FRACTION * timeout if stall is not None and stall < 0 else stall
        self.text, self.probe = text, probe
        self.warned = False

    def waited(self) -> float:
        return time.monotonic() - self.began

    def due(self) -> bool:
        """Warn once past the stall point; apply the policy past the deadline (for loops that
        poll on their own). True once the policy ran (a ``fail`` that does not raise)."""
        waited = self.waited()
        if waited > self.timeout:
            if self.text is not None:
                message = self.text("timeout", waited)
            else:
                message = _with_others(f"waited {self.timeout:.0f} s {self._place()} for "
                                       f"{self.awaited()}")
                message += " (HVD_SGP_TIMEOUT)" if self.fail else f" {self.hint}".rstrip()
            if self.fail is not None:
                self.fail(message)
                return True
            expire(message, self.error)
        if not self.warned and self.stall is not None and waited > self.stall:
            self.warned = True
            stall_warning(self.text("stall", waited) if self.text is not None else _with_others(
                f"stalled {waited:.0f} s {self._place()} waiting for {self.awaited()}") +
                f"; the job fails after {self.timeout:.0f} s")
        return False

    def _place(self) -> str:
        return place(self.what, self.iteration)

    def until(self, done: Callable[[], bool]) -> None:
        """Poll ``done`` (a request's Test) with a growing pause until it holds, checking the
        deadline between polls."""
        pause = 2e-6
        probe_at = self.began + PROBE_SECONDS
        while not done():
            self.due()
            if self.probe is not None and time.monotonic() >= probe_at:
                self.probe()
                probe_at = time.monotonic() + PROBE_SECONDS
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE)
