"""Stopped peers, which ULFM's detector does not see (fault-tolerant mode).

A replacement spawned by a grow (world_grow) is an MPI job of its own, and ULFM's heartbeat
detector watches only the ranks of its own job (open-mpi/ompi#13325). A stopped replacement
(SIGSTOP, a debugger, a frozen container) is then never declared failed: the survivors' wait
on it ends at HVD_SGP_TIMEOUT, and the repair's MPI_Comm_shrink waits for it until it runs
again. A rank on the same machine can see it: a peer whose process the kernel shows stopped
('T' or 't' in /proc/PID/stat) for the detector's timeout is killed, which the runtime
reports to every rank at once, as it does any killed process. This is what ULFM does to a
rank its detector declares dead (Open MPI aborts it), done for the ranks it does not watch,
and it applies to every peer alike (an original rank so stopped is declared dead anyway).

A peer is named by ``identity()``: machine (the kernel's boot id), pid and start time, so
that a pid reused, or seen from another pid namespace, is never taken for it.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
from typing import Optional

Identity = Optional[tuple]  # (boot id, pid, start time), or None where /proc is absent
_STOPPED = ("T", "t")


def _stat(pid: int) -> Optional[tuple]:
    """(state, start time) of process ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


@functools.cache  # (it changes only with a reboot; checked every second)
def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return None


def identity() -> Identity:
    """This process, as a peer on the same machine can check it."""
    boot, stat = _boot_id(), _stat(os.getpid())
    return None if boot is None or stat is None else (boot, os.getpid(), stat[1])


def alive_here(peer: Identity) -> Optional[bool]:
    """Whether ``peer`` still runs, where it is on this machine; None elsewhere (or unknown)."""
    if peer is None or peer[0] != _boot_id():
        return None
    stat = _stat(peer[1])
    return stat is not None and stat[1] == peer[2]


def kill(peer: Identity) -> bool:
    """Kill ``peer`` if it runs on this machine (and is still that process); whether it did."""
    if not alive_here(peer):
        return False
    try:
        os.kill(peer[1], signal.SIGKILL)
    except OSError:
        return False
    return True


class Sentinel:
    """Kills the peers on this machine that stay stopped for ``seconds`` (checked by the
    fault-tolerant heartbeat thread, fault_mode._watch, every ``PERIOD`` seconds)."""

    PERIOD = 1.0

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.since: dict = {}  # identity -> when it was first seen stopped
        self.checked = 0.0

    def check(self, peers: list, now: Optional[float] = None) -> list:
        """``peers``: (name, identity) of every rank of the world (its origin) and of every
        warm spare (a phrase). Returns the names killed."""
        now = time.monotonic() if now is None else now
        if now - self.checked < self.PERIOD:
            return []
        self.checked = now
        boot, killed, stopped = _boot_id(), [], {}
        for name, peer in peers:
            if peer is None or peer[0] != boot or peer[1] == os.getpid():
                continue
            stat = _stat(peer[1])
            if stat is None or stat[1] != peer[2] or stat[0] not in _STOPPED:
                continue
            stopped[peer] = self.since.get(peer, now)
            if now - stopped[peer] >= self.seconds:
                if not kill(peer):
                    continue
                killed.append(name)
                who = f"rank {name}" if isinstance(name, int) else name
                print(f"hvd_sgp: {who} (pid {peer[1]}, on this machine) was stopped for "
                      f"{now - stopped[peer]:.0f} s: killed, so that the others repair "
                      "without it (ULFM's detector does not watch a spawned replacement)",
                      file=sys.stderr, flush=True)
        self.since = stopped
        return killed
