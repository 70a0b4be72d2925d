"""The harness of every ``<area>_checks.py`` script that ``test_<area>.py`` launches under MPI.

Many checks run per launch (start-up costs seconds). A check is a function registered with
``@checks``; it raises on failure (an uncaught exception ends the whole job through hvd_sgp's
MPI_Abort hook, so no rank waits forever) and returns the line to print. Each passed check is
followed by a barrier, and rank 0 prints ``ok <line>  [elapsed]``; the last line is
``all <area> checks passed on N ranks``. Arguments on the command line choose checks by name.
Inside a check, ``checks.verify(line, condition)`` reports one result of several: every rank's
verdict is gathered, so a failure on one rank is named on all and the job exits 1 cleanly.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional


class Checks:
    """The checks of one area, run in registration order (or those named in argv)."""

    def __init__(self, area: str, rank: Callable[[], int], size: Callable[[], int],
                 barrier: Callable[[], None], allgather: Optional[Callable[[object], list]] = None):
        self.area = area
        self._rank, self._size, self._barrier = rank, size, barrier
        self._allgather = allgather
        self._checks: list[Callable[[], Optional[str]]] = []
        self._began = time.perf_counter()

    def __call__(self, check: Callable[[], Optional[str]]) -> Callable[[], Optional[str]]:
        self._checks.append(check)
        return check

    def when(self, condition: bool) -> Callable:
        """Register the check only where ``condition`` holds (a layout, a number of ranks)."""
        return self if condition else (lambda check: check)

    def ok(self, line: str) -> None:
        """Report a result from inside a check that has several (every rank calls it)."""
        self._barrier()
        if self._rank() == 0:
            print(f"ok {line}  [{time.perf_counter() - self._began:.0f}s]", flush=True)

    def verify(self, line: str, condition: object, detail: str = "") -> None:
        """One result: fails (on every rank, exit 1) if ``condition`` is false on any rank."""
        verdicts = self._allgather((bool(condition), detail))
        bad = [(r, d) for r, (good, d) in enumerate(verdicts) if not good]
        if bad:
            if self._rank() == 0:
                print(f"FAIL {line}: failing ranks and details {bad}", flush=True)
            sys.exit(1)
        self.ok(line + (f": {detail}" if detail else ""))

    def run(self, argv: Optional[list[str]] = None) -> None:
        chosen = set(sys.argv[1:] if argv is None else argv)
        known = {check.__name__ for check in self._checks}
        if chosen - known:
            raise SystemExit(f"unknown checks {sorted(chosen - known)}; known: {sorted(known)}")
        for check in self._checks:
            if not chosen or check.__name__ in chosen:
                line = check()
                if line:
                    self.ok(line)
        self._barrier()
        if self._rank() == 0:
            print(f"all {self.area} checks passed on {self._size()} ranks", flush=True)


def expect_error(kind: type, action: Callable[[], object], rank: Optional[int] = None,
                 fragments: tuple = ()) -> BaseException:
    """``action()`` must raise ``kind``, naming ``rank`` (``error.rank``) when given, and
    containing ``fragments`` only where no type tells the case apart (Horovod's messages)."""
    try:
        action()
    except kind as error:
        if rank is not None:
            assert getattr(error, "rank", None) == rank, (error, rank)
        assert all(f in str(error) for f in fragments), (error, fragments)
        return error
    raise AssertionError(f"no {kind.__name__} raised")
