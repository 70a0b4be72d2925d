"""Host discovery, as horovodrun's ``--host-discovery-script``: the script prints the hosts
that may run ranks now, one ``host:slots`` line each (``host`` alone takes
``--slots-per-host``).

``sgprun`` runs it once before the launch, to choose the hosts and the number of ranks (all the
slots it finds, at most ``--max-np``), and hands the ranks what it found
(``HVD_SGP_DISCOVERED_HOSTS``). From then on the world's rank 0 runs it every
``HVD_SGP_DISCOVERY_INTERVAL`` seconds (1 s, Horovod's period) in a thread of its own
(``Poller``): a list with fewer than ``HVD_SGP_MIN_NP`` slots is held back while training goes
on, for up to ``HVD_SGP_ELASTIC_TIMEOUT`` seconds, as horovodrun waits for slots (a file being
rewritten reads empty for a moment). ``state.commit()`` broadcasts rank 0's latest result, so
every rank sees a change at the same commit (hvd_sgp/common/horovod_api/elastic.py), and the
runtime then grows or shrinks the world to the new hosts (runtime.resize). No MPI here: the
launcher imports it.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Optional

VARIABLE = "HVD_SGP_DISCOVERED_HOSTS"  # what sgprun found at launch: "host:slots,..." in order
SCRIPT_SECONDS = 60.0  # a run of the script that takes longer counts as a failed run

Hosts = list  # [(name, slots), ...] in assignment order


class DiscoveryError(ValueError):
    """The discovery script failed or printed something that is not a host list."""


def parse(text: str, default_slots: Optional[int], source: str) -> Hosts:
    """The ``host:slots`` (or ``host``) lines of ``text``, in order; blank lines are skipped
    (a script with no host ready prints nothing). ``source`` names the script in errors."""
    hosts: dict = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        name, sep, slots = line.partition(":")
        if sep:
            if not slots.strip().isdigit() or int(slots) < 1:
                raise DiscoveryError(f"{source} printed {raw.strip()!r} (line {number}): "
                                     "expected host:slots with slots a positive integer")
            count = int(slots)
        elif default_slots is None:
            raise DiscoveryError(f"{source} printed {raw.strip()!r} (line {number}) without "
                                 "a slot count: print host:slots or give --slots-per-host")
        else:
            count = default_slots
        name = name.strip()
        if not name or any(c.isspace() for c in name):
            raise DiscoveryError(f"{source} printed {raw.strip()!r} (line {number}): "
                                 "expected host:slots")
        if name in hosts:
            raise DiscoveryError(f"{source} names host {name!r} twice")
        hosts[name] = count
    return list(hosts.items())


def run_script(command: str, default_slots: Optional[int],
               timeout: float = SCRIPT_SECONDS) -> Hosts:
    """Run the discovery command through the shell (as horovodrun does) and parse its output."""
    source = f"the host discovery script {command!r}"
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"{source} did not finish within {timeout:g} s") from None
    except OSError as error:
        raise DiscoveryError(f"{source} could not run: {error}") from None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
        raise DiscoveryError(f"{source} exited with status {done.returncode} ({said[0]})")
    return parse(done.stdout, default_slots, source)


def encode(hosts: Hosts) -> str:
    """``host:slots,...``: how the launcher hands the hosts to the ranks."""
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


def describe(hosts: Hosts) -> str:
    """``encode`` for messages, where an empty list must still read as one."""
    return encode(hosts) or "no host"


def decode(text: str) -> Hosts:
    """The inverse of ``encode``."""
    return parse(text.replace(",", "\n"), None, VARIABLE)


def total(hosts: Hosts) -> int:
    return sum(slots for _, slots in hosts)


def assign(hosts: Hosts, count: int) -> list:
    """The host of each of the first ``count`` ranks: hosts filled in order, slot by slot,
    as ``mpirun -H ... --map-by slot`` places them."""
    order = [name for name, slots in hosts for _ in range(slots)]
    if count > len(order):
        raise DiscoveryError(f"{count} ranks do not fit the {len(order)} slots of "
                             f"{encode(hosts)}")
    return order[:count]


def merged_order(before: Hosts, now: Hosts) -> Hosts:
    """``now`` in assignment order: the hosts kept from ``before`` first, in their order, then
    the new ones (Horovod keeps the oldest hosts first, so rank 0 stays on one of them)."""
    slots = dict(now)
    kept = [(name, slots[name]) for name, _ in before if name in slots]
    known = {name for name, _ in before}
    return kept + [(name, count) for name, count in now if name not in known]


ADDED, REMOVED = 2, 1  # Horovod's HostUpdateResult flags


class Poller:
    """Runs the discovery script every ``interval`` seconds in a daemon thread and keeps the
    last host list it printed. A failed run keeps the previous list and says why on stderr
    (once per distinct error), as Horovod retries transient failures. A list with fewer than
    ``minimum`` slots is held back (the previous one stays) until a later run finds enough or
    ``patience`` seconds have passed since the first short one; then it is taken, and the job
    ends at the next commit (world_grow.resize)."""

    def __init__(self, command: str, default_slots: Optional[int], interval: float,
                 minimum: int = 1, patience: float = float("inf")):
        self.command, self.default_slots, self.interval = command, default_slots, interval
        self.minimum, self.patience = minimum, patience
        self._latest: Optional[Hosts] = None
        self._said: Optional[str] = None
        self._short_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd_sgp-discovery", daemon=True)
        self._thread.start()

    def latest(self) -> Optional[Hosts]:
        """The hosts of the last successful run that counts; None before the first one (a
        short first list, on a rank 0 that took over, is held back too)."""
        return self._latest

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take(run_script(self.command, self.default_slots))
            except DiscoveryError as error:
                self._say(f"{error}; keeping the last host list")
            self._stop.wait(self.interval)

    def _take(self, hosts: Hosts) -> None:
        if total(hosts) >= self.minimum:
            self._latest, self._short_since = hosts, None
            return
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since >= self.patience:
            self._latest = hosts
            return
        self._say(f"the host discovery script found {describe(hosts)}, fewer than the "
                  f"{self.minimum} slots of HVD_SGP_MIN_NP; training goes on and the job ends "
                  f"if it still finds too few {self.patience:g} s after")

    def _say(self, warning: str) -> None:
        if warning != self._said:
            self._said = warning
            print(f"hvd_sgp: warning: {warning}", file=sys.stderr, flush=True)


_poller: list = []  # the running Poller, at most one per process


def poll(command: str, default_slots: Optional[int], interval: float, minimum: int = 1,
         patience: float = float("inf")) -> Poller:
    """The process's poller, started on first call."""
    if not _poller:
        _poller.append(Poller(command, default_slots, interval, minimum, patience))
    return _poller[0]


def stop_polling() -> None:
    """Stop the poller (this process is no longer the world's rank 0)."""
    while _poller:
        _poller.pop().stop()

