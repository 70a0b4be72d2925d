"""What each rank of a fault-tolerant job says about its end, for sgprun's exit status.

mpirun reports a non-zero status when a rank that the survivors excluded exited non-zero (a
crashed worker), even though training completed. Under ``sgprun --fault-tolerant`` every rank
appends one-line events to its own file in a directory named by ``HVD_SGP_FAULT_RECORD``:
``started``, ``lost <ranks>`` (written by the survivors after a repair), ``joined <ranks>``
(replacements or newcomers taken in, by their launch ranks), ``left`` (a rank whose host the
discovery script removed, leaving by plan), ``noticed <what>`` (a lost peer noticed here,
recovery.lost), ``failed`` (an uncaught exception), ``finished``
(normal interpreter exit), ``finalizing <seconds>`` (MPI_Finalize begins, the process
ending within those seconds at the latest: its exit alarm) and ``finalized`` (it returned).
``verdict`` reads them back.
No MPI here: the launcher imports it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

VARIABLE = "HVD_SGP_FAULT_RECORD"
# MPI_Finalize once every rank has met at exit: 0.06-0.2 s on this host (2 ranks after 6
# repairs), or never after some repairs (fault_mode._finalize); past this it is the latter.
FINALIZE_SECONDS = 5


def exit_alarm(met: bool, detector_timeout: float) -> int:
    """Seconds a rank's MPI_Finalize is given before its alarm ends the process: short once
    every rank met at exit, else the detector's timeout + 10 s (it may wait for a peer's)."""
    return FINALIZE_SECONDS if met else int(detector_timeout) + 10


def write(event: str, rank: int, environ: Optional[dict] = None) -> None:
    """Append ``event`` to rank ``rank``'s file, if the launcher asked for records."""
    directory = (os.environ if environ is None else environ).get(VARIABLE)
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"rank{rank}"), "a", encoding="utf-8") as handle:
            handle.write(event + "\n")
    except OSError:
        pass  # a record is a courtesy to the launcher; never fail training over it


@dataclass
class Verdict:
    """What the records say: the ranks that started, finished, failed, were lost, joined
    later (spawned), and left by plan."""

    started: set = field(default_factory=set)
    finished: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    lost: set = field(default_factory=set)
    joined: set = field(default_factory=set)
    left: set = field(default_factory=set)
    finalizing: dict = field(default_factory=dict)  # rank -> seconds its exit alarm allows
    finalized: set = field(default_factory=set)

    @property
    def alarmed(self) -> set:
        """Ranks whose MPI_Finalize never returned (their exit alarm or the head's end ended
        them), lost ranks aside."""
        return set(self.finalizing) - self.finalized - self.lost

    @property
    def completed(self) -> bool:
        """Training completed: some rank finished, and every rank that did not finish, or
        failed, is one the survivors excluded or one that left by plan."""
        return (bool(self.finished) and not (self.failed - self.lost)
                and self.started <= self.finished | self.lost | self.left)

    def covers(self, ranks: int) -> bool:
        """The records hold the launch's ``ranks`` (they are missing where ranks on other
        hosts write to their own machine, with no shared /tmp)."""
        return set(range(ranks)) <= self.started

    def ended(self, ranks: int) -> bool:
        """Every rank has ended by its records (finished, failed, lost or left), the launch's
        ``ranks`` among them."""
        return (self.covers(ranks)
                and self.started <= self.finished | self.failed | self.lost | self.left)

    def gone_within(self, otherwise: float) -> float:
        """Seconds within which the processes of ranks that ended are gone, by the exit
        alarms they recorded (lost ranks are dead or were killed); ``otherwise`` where a rank
        that ended has not recorded its alarm yet."""
        ending = (self.finished | self.failed | self.left) - self.lost
        if not ending <= set(self.finalizing):
            return otherwise
        return max((self.finalizing[rank] for rank in ending), default=0.0)


def verdict(directory: str) -> Verdict:
    """Read every rank's events from ``directory``."""
    result = Verdict()
    for name in sorted(os.listdir(directory)):
        if not name.startswith("rank") or not name[4:].isdigit():
            continue
        rank = int(name[4:])
        with open(os.path.join(directory, name), encoding="utf-8") as handle:
            for line in handle:
                event, _, rest = line.strip().partition(" ")
                if event in ("lost", "joined"):
                    getattr(result, event).update(int(r) for r in rest.split(",") if r)
                elif event == "finalizing":
                    result.finalizing[rank] = float(rest)
                elif event in ("started", "finished", "failed", "left", "finalized"):
                    getattr(result, event).add(rank)
    return result
