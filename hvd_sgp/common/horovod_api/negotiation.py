"""Negotiation: the ranks of a process set agree on every Horovod-API collective before any
data moves, so a mismatch raises one clear error on every rank instead of a hang or garbage.

One ``Controller`` per process set, on a private duplicate of the set's communicator; set
rank 0 coordinates.

1. submit: a rank describes its op as a ``Request`` (kind, name, every tensor's shape, dtype,
   wire dtype and device, op, root, pre/postscale, kind-specific facts, and any argument error
   it found) and sends it to the coordinator, which files its own in place. Unnamed ops are
   named ``noname.<epoch>.<n>`` from one counter per set: they meet in submission order,
   and two different kinds under one name are caught as such.
2. the coordinator files requests by name. Once every rank has one (a joined rank counts as
   present for the kinds it can serve), it compares them and sends every rank one ``Response``:
   OK with what the data phase needs (each rank's first dimensions, the joined ranks and the
   request they mirror), or an error naming the problem and the ranks.
3. every rank applies the responses in the coordinator's order and starts the data phases --
   non-blocking MPI collectives on the same private communicator -- in that order, so they
   match on every rank. A data phase of several steps (alltoall: counts, then rows) holds back
   later starts until its last step is posted.

Nothing blocks inside MPI: waits poll ``progress_all()``, then sleep with a backing-off
pause (a rank blocked on a late peer uses a few % of a core). The coordinator warns about an
op some ranks have not submitted after HOROVOD_STALL_CHECK_TIME_SECONDS (default 60;
HOROVOD_STALL_CHECK_DISABLE=1 turns the warning off) and fails it on every rank after
HVD_SGP_TIMEOUT (default 300), naming the missing ranks; a rank whose coordinator stays
silent fails by itself a little later. A timeout breaks the controller: every later op on
it fails at once with the same message.

In fault-tolerant mode (recovery.py) a lost peer met by any MPI call here breaks the
controller the same way with PeerLostError (a HorovodInternalError) and revokes every hvd_sgp
communicator, these controllers' included (they are tracked by the runtime), so the ranks
waiting on a live coordinator learn too; the repair then replaces every controller
(process_sets subscribes to world.on_world_change).
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional

from hvd_sgp.common import recovery
from hvd_sgp.common.errors import (CollectiveTimeoutError, HorovodInternalError, PeerLostError,
                                   SgpValueError)
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.waiting import Wait
from hvd_sgp.common.world import untrack

TAG_REQUEST, TAG_RESPONSE, TAG_CHAIN = 1, 2, 3  # (TAG_CHAIN: a broadcast's segments)
SPIN_SECONDS = 1e-3  # a waiter polls back to back while something moved this recently
DATA_SPIN_SECONDS = 0.02  # (this long while a data phase runs),
MAX_PAUSE_SECONDS = 1e-3  # then sleeps, doubling up to this, or in a long quiet wait up to
LONG_PAUSE_SECONDS = 5e-3  # a twentieth of the quiet time, at most this (ends <= 5% late)


@dataclass(frozen=True)
class Settings:
    """The collective layer's deadlines, read once where it starts (``from_environ``)."""

    timeout: float = 300.0
    stall_warning: Optional[float] = 60.0  # None: no stall warning

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if environ is None else environ
        timeout = _seconds(env, "HVD_SGP_TIMEOUT", 300.0)
        disabled = env.get("HOROVOD_STALL_CHECK_DISABLE", "").strip().lower()
        stall = (None if disabled in ("1", "true", "yes", "on")
                 else _seconds(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0))
        return cls(timeout, stall)


def _seconds(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SgpValueError(f"{key}={raw!r} must be a positive number of seconds")
    return value


class TensorSpec(NamedTuple):
    shape: tuple
    dtype: str  # the framework's dtype: mismatches are named in the user's terms
    wire: str  # the numpy dtype handed to the core: what a joined rank mirrors
    device: str


class Request(NamedTuple):
    kind: str
    name: str
    specs: tuple = ()
    op: int = -1
    root: int = -1  # a broadcast's root, as a global rank
    prescale: float = 1.0
    postscale: float = 1.0
    extra: tuple = ()  # kind-specific facts every rank must share
    error: str = ""  # an argument error found on the sender: the op fails on every rank


class Response(NamedTuple):
    name: str
    error: str = ""
    request: Optional[Request] = None  # with joined ranks: the request they mirror
    first_dims: tuple = ()  # per tensor, every set rank's first dimension
    joined: tuple = ()  # set ranks that take part as joined ranks
    last_joined: int = -1  # join: the global rank that joined last
    fatal: bool = False  # the controller is broken (timeout)


class Kind:
    """How the ranks agree on one kind of collective and move its data. collectives.py and
    join.py register one per kind; the controller knows none by itself."""

    name = ""
    joinable = False  # a joined rank takes part with a neutral contribution

    def check(self, requests: dict[int, Request], ctl: "Controller") -> str:
        """'' when the ranks' requests (by set rank) agree, else the problem, naming ranks."""
        return ""

    def first_dims(self, requests: dict[int, Request]) -> tuple:
        return ()

    def phase(self, op: "Operation", ctl: "Controller") -> Iterator[tuple[list, bool]]:
        """The data phase as a generator: it posts MPI calls and yields (requests, more); more
        is True while it will post further calls once these complete. Its return value is the
        op's result."""
        raise NotImplementedError


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    return kind


class Operation:
    """One collective on this rank: negotiating, then moving data, then done or failed."""

    def __init__(self, request: Request, arrays: Optional[list], abandoned: bool = False,
                 into: bool = False):
        self.request = request
        self.arrays = arrays  # None: a joined rank mirroring the others' op
        self.into = into  # this rank's arrays may receive the result (in place; local)
        self.abandoned = abandoned  # its argument error was raised already; drop the answer
        self.response: Optional[Response] = None
        self.submitted = time.monotonic()
        self.started = 0.0
        self.steps: Optional[Iterator] = None
        self.mpi: list = []
        self.more = False
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.wait: Optional[Wait] = None  # this rank's deadline on the coordinator's answer
        self.data_wait: Optional[Wait] = None  # the deadline of its data phase

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error, self.done = result, error, True


class Handle:
    """A collective in flight: ``done()`` polls it, ``wait()`` returns its result or raises
    its error (the same one on every rank of the set)."""

    def __init__(self, op: Operation, transform: Callable[[Any], Any] = lambda r: r):
        self._op = op
        self._transform = transform

    def done(self) -> bool:
        progress_all()
        return self._op.done

    def wait(self) -> Any:
        wait_until(lambda: self._op.done)
        if self._op.error is not None:
            raise self._op.error
        return self._transform(self._op.result)


class _Entry:
    """The coordinator's file on one name: who has submitted what."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}
        self.duplicated: set[int] = set()
        self.first_seen = time.monotonic()
        self.wait: Optional[Wait] = None  # the coordinator's deadline on the missing ranks


class Controller:
    """Negotiation and data phases of one process set on this rank (see the module doc)."""

    def __init__(self, comm: MPI.Comm, set_id: int, ranks: Iterable[int], settings: Settings):
        self.comm = comm  # private: only this controller's messages and collectives
        self.set_id = set_id
        self.ranks = tuple(ranks)  # the global rank of each set rank
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.settings = settings
        self.coordinator = self.rank == 0
        self.live: dict[str, Operation] = {}  # submitted here and not done, by name
        self.pending: dict[str, Operation] = {}  # ... and still waiting for the response
        self.starting: deque[Operation] = deque()  # answered, data phase not fully posted
        self.running: list[Operation] = []  # every MPI call posted
        self.outbox: list[tuple[MPI.Request, bytes]] = []
        self.broken = ""
        self.broken_error: type = CollectiveTimeoutError
        self.closed = False
        self.unnamed = self.epoch = 0
        self.table: dict[str, list[_Entry]] = {}  # coordinator: name -> instances in order
        self.joined: list[int] = []  # coordinator: set ranks in the order they joined

    # --- submitting -------------------------------------------------------------------------
    def next_name(self) -> str:
        """A name for an unnamed op. The count restarts, in a new epoch, after every join:
        a joined rank submitted none of the ops it served, so counts differed until then."""
        self.unnamed += 1
        return f"noname.{self.epoch}.{self.unnamed}"

    def submit(self, request: Request, arrays: Optional[list], into: bool = False) -> Operation:
        """File ``request`` (with its arrays) for negotiation. A request carrying an argument
        error is still sent, so the other ranks fail too; the caller raises it here."""
        earlier = self.live.get(request.name)
        if earlier is not None:
            self._to_coordinator(("duplicate", request.name))
            why = ("its earlier submission failed here and the other ranks have not reached it "
                   "yet" if earlier.abandoned else "names must be unique among concurrent "
                   "collectives")
            raise SgpValueError(f"{request.kind} {request.name!r}: a collective with this name "
                                f"is already in flight on this rank{self._where()}; {why}")
        op = Operation(request, arrays, abandoned=bool(request.error), into=into)
        if self.broken:
            op.finish(error=self._broken_error())
            return op
        self.live[request.name] = op
        self.pending[request.name] = op
        self._to_coordinator(("request", request))
        return op

    def _to_coordinator(self, message: tuple) -> None:
        if self.coordinator:
            self._file(self.rank, message)
        else:
            self._send(pickle.dumps(message, pickle.HIGHEST_PROTOCOL), 0, TAG_REQUEST)

    def _send(self, data: bytes, dest: int, tag: int) -> None:
        try:
            self.outbox.append((self.comm.Isend([data, MPI.BYTE], dest, tag), data))
        except MPI.Exception as error:
            self._lost_peer(error)

    def _receive(self, source: int, tag: int) -> Optional[tuple[int, Any]]:
        status = MPI.Status()
        message = self.comm.improbe(source, tag, status)
        if message is None:
            return None
        data = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([data, MPI.BYTE])
        return status.Get_source(), pickle.loads(data)

    # --- progress ---------------------------------------------------------------------------
    def progress(self) -> bool:
        """One non-blocking pass over everything in flight; True when something moved."""
        if self.closed:
            return False
        try:
            return self._progress()
        except MPI.Exception as error:
            self._lost_peer(error)
            return True

    def _progress(self) -> bool:
        moved = self._flush_outbox()
        if self.coordinator:
            while (incoming := self._receive(MPI.ANY_SOURCE, TAG_REQUEST)) is not None:
                self._file(*incoming)
                moved = True
            moved |= self._resolve()
        else:
            while (incoming := self._receive(0, TAG_RESPONSE)) is not None:
                self._apply(incoming[1])
                moved = True
            self._check_silence()
        return self._advance() or moved

    def _flush_outbox(self) -> bool:
        if not self.outbox:
            return False
        before = len(self.outbox)
        self.outbox = [(r, d) for r, d in self.outbox if not r.Test()]
        return len(self.outbox) != before

    # --- the coordinator --------------------------------------------------------------------
    def _file(self, rank: int, message: tuple) -> None:
        what, payload = message
        if self.broken:
            return  # the fatal response already sent tells the sender
        if what == "duplicate":
            for entry in self.table.get(payload, ()):
                if rank in entry.requests:
                    entry.duplicated.add(rank)
                    break
            return
        entries = self.table.setdefault(payload.name, [])
        entry = next((e for e in entries if rank not in e.requests), None)
        if entry is None:
            entry = _Entry()
            entries.append(entry)
        entry.requests[rank] = payload
        if payload.kind == JOIN and rank not in self.joined:
            self.joined.append(rank)

    def _resolve(self) -> bool:
        """Answer every name whose oldest instance is complete; join last, as it ends the
        joined ranks' service."""
        moved = False
        for name in list(self.table):
            entries = self.table[name]
            if name == JOIN:
                continue
            response = self._verdict(name, entries[0])
            if response is None:
                self._check_stall(name, entries[0])
                if self.broken:
                    return True
                continue
            entries.pop(0)
            if not entries:
                del self.table[name]
            self._respond(response)
            moved = True
        if JOIN in self.table:
            entry = self.table[JOIN][0]
            response = self._verdict(JOIN, entry)
            if response is None:
                self._check_stall(JOIN, entry)
            else:
                del self.table[JOIN]
                self.joined = []
                self._respond(response)
                moved = True
        return moved

    def _verdict(self, name: str, entry: _Entry) -> Optional[Response]:
        requests = entry.requests
        if len(requests) < self.size and (not self.joined or any(
                r not in requests and r not in self.joined for r in range(self.size))):
            return None
        stand_ins = tuple(r for r in range(self.size) if r not in requests)
        kinds = {r: q.kind for r, q in requests.items()}
        first = requests[min(requests)]
        label = f"{first.kind} {name!r}{self._where()}"
        if len(set(kinds.values())) > 1:
            return Response(name, f"ranks called different collectives under the name "
                                  f"{name!r}{self._where()}: {self.disagreement(kinds)}")
        errors = {r: q.error for r, q in requests.items() if q.error}
        if errors:
            return Response(name, f"{label} failed: " + "; ".join(
                f"rank {self.ranks[r]}: {message}" for r, message in sorted(errors.items())))
        if entry.duplicated:
            return Response(name, f"{label} was submitted again on "
                                  f"{self.rank_list(entry.duplicated)} while still in flight")
        kind = KINDS[first.kind]
        if stand_ins and not kind.joinable:
            return Response(name, f"{label} cannot run: {self.rank_list(stand_ins)} already "
                                  "called join(); only allreduce, reducescatter and barrier "
                                  "take joined ranks along")
        problem = "" if len(set(requests.values())) == 1 else kind.check(requests, self)
        if problem:
            return Response(name, f"{label}: {problem}")
        return Response(name, request=first if stand_ins else None,
                        first_dims=kind.first_dims(requests), joined=stand_ins,
                        last_joined=self.ranks[self.joined[-1]] if name == JOIN else -1)

    def _respond(self, response: Response) -> None:
        if self.size > 1:
            data = pickle.dumps(response, pickle.HIGHEST_PROTOCOL)
            for r in range(1, self.size):
                self._send(data, r, TAG_RESPONSE)
        self._apply(response)

    def _check_stall(self, name: str, entry: _Entry) -> None:
        if name == JOIN:
            return  # joined ranks wait as long as others make progress: join() watches that
        if entry.wait is None:
            entry.wait = Wait(name, lambda: "", self.settings.timeout, began=entry.first_seen,
                              stall=self.settings.stall_warning,
                              fail=lambda message: self._expire(name, entry, message),
                              text=lambda kind, waited: self._stall_text(entry, kind, waited))
        entry.wait.due()

    def _stall_text(self, entry: _Entry, kind: str, waited: float) -> str:
        joined = set(self.joined)
        missing = [r for r in range(self.size) if r not in entry.requests and r not in joined]
        first = next(iter(entry.requests.values()))
        label = f"{first.kind} {first.name!r}{self._where()}"
        timeout = self.settings.timeout
        if kind == "timeout":
            return (f"{label} timed out after {timeout:.0f} s waiting for "
                    f"{self.rank_list(missing)} (submitted by "
                    f"{self.rank_list(entry.requests)}): a rank died, froze or runs "
                    "different collectives; raise HVD_SGP_TIMEOUT if this is a slow start")
        return (f"stall: {label} has waited {waited:.0f} s for {self.rank_list(missing)} "
                f"(submitted by {self.rank_list(entry.requests)}); it fails after "
                f"{timeout:.0f} s (HVD_SGP_TIMEOUT)")

    def _expire(self, name: str, entry: _Entry, message: str) -> None:
        """An entry past the deadline: where its senders raised already, only it fails;
        otherwise the set breaks."""
        if any(q.error for q in entry.requests.values()):
            self.table[name].remove(entry)
            if not self.table[name]:
                del self.table[name]
            self._respond(Response(name, message))
        else:
            self._break(message)

    # --- every rank -------------------------------------------------------------------------
    def _apply(self, response: Response) -> None:
        if response.fatal:
            self._break(response.error)
            return
        op = self.pending.pop(response.name, None)
        if op is None:
            if response.error:
                return  # the others' failure while this rank was joined
            if self.rank not in response.joined:
                self._break(f"internal error: a response for {response.name!r}, which this "
                            "rank never submitted", error=HorovodInternalError)
                return
            op = Operation(response.request, None)  # take part as a joined rank
        if _timeline is not None:
            _timeline.negotiated(op, response)
        if op.abandoned or response.error:
            self._retire(op, HorovodInternalError(response.error) if response.error else None)
            return
        op.response = response
        self.starting.append(op)
        if response.name == JOIN:
            self.epoch, self.unnamed = self.epoch + 1, 0

    def _advance(self) -> bool:
        """Start data phases in response order; test the ones in flight."""
        moved = False
        now = time.monotonic()
        while self.starting:
            op = self.starting[0]
            if op.steps is None:
                op.steps, op.started = KINDS[op.request.kind].phase(op, self), now
            elif not MPI.Request.Testall(op.mpi):
                break
            self._step(op)
            moved = True
            if op.more and not op.done:
                break  # its next step must be posted before any later op's first
            self.starting.popleft()
            if not op.done:
                self.running.append(op)
        for op in list(self.running):
            if MPI.Request.Testall(op.mpi):
                self._step(op)
                moved = True
            elif self._data_wait(op).due():
                return True
            if op.done and op in self.running:
                self.running.remove(op)
        return moved

    def _data_wait(self, op: Operation) -> Wait:
        """The deadline of an agreed op's data phase: every rank agreed, so it ends soon."""
        if op.data_wait is None:
            op.data_wait = Wait(op.request.name, lambda: "", self.settings.timeout, began=op.started,
                           stall=None, fail=self._break, text=lambda kind, waited: (
                               f"{op.request.kind} {op.request.name!r}{self._where()} moved no "
                               f"data for {self.settings.timeout:.0f} s after every rank agreed "
                               "on it: a rank died or stopped making progress"))
        return op.data_wait

    def _step(self, op: Operation) -> None:
        try:
            op.mpi, op.more = next(op.steps)
        except StopIteration as stop:
            self._retire(op, None, stop.value)
        except Exception as error:  # noqa: BLE001  (fail the op, not the progress loop)
            if isinstance(error, MPI.Exception) and recovery.is_failure(error):
                self._lost_peer(error)
            else:
                self._retire(op, error)

    def _retire(self, op: Operation, error: Optional[BaseException], result: Any = None) -> None:
        op.finish(result, error)
        if self.live.get(op.request.name) is op:
            del self.live[op.request.name]
        if _timeline is not None and op.started:
            _timeline.moved(op)

    def _check_silence(self) -> None:
        """A non-coordinator's own deadline, for when the coordinator does not poll."""
        for op in list(self.pending.values()):
            if op.abandoned or op.request.kind == JOIN:
                continue
            if op.wait is None:
                op.wait = Wait(op.request.name, lambda: "", self.settings.timeout * 1.1 + 1.0,
                               began=op.submitted, stall=self.settings.stall_warning,
                               fail=self._break,
                               text=lambda kind, waited, op=op: self._silence_text(op, kind,
                                                                                   waited))
            if op.wait.due():
                return

    def _silence_text(self, op: Operation, kind: str, waited: float) -> str:
        label = f"{op.request.kind} {op.request.name!r}{self._where()}"
        if kind == "timeout":
            return (f"{label}: no answer from the coordinator (rank {self.ranks[0]}) after "
                    f"{waited:.0f} s; it, or a rank it waits for, has not submitted this "
                    "collective (HVD_SGP_TIMEOUT)")
        return (f"stall: {label} has waited {waited:.0f} s for the other ranks; the "
                f"coordinator (rank {self.ranks[0]}) names the missing ones")

    def missing_joins(self) -> str:
        """The coordinator's list of ranks that have not joined ('' elsewhere)."""
        if not self.coordinator:
            return ""
        return self.rank_list(r for r in range(self.size) if r not in self.joined)

    def fail(self, message: str) -> None:
        """Give up on this set (a deadline passed): every op fails, now and later."""
        self._break(message)

    def _break(self, message: str, notify: bool = True,
               error: type = CollectiveTimeoutError) -> None:
        """After a timeout nothing on this set can be trusted: fail everything, now and later,
        with ``error`` (the coordinator tells every rank unless ``notify`` is False)."""
        if self.broken:
            return
        self.broken, self.broken_error = message, error
        if notify and self.coordinator and self.size > 1:
            data = pickle.dumps(Response("", message, fatal=True), pickle.HIGHEST_PROTOCOL)
            for r in range(1, self.size):
                self._send(data, r, TAG_RESPONSE)
        for op in [*self.pending.values(), *self.starting, *self.running]:
            op.finish(error=self._broken_error())
        self.pending.clear()
        self.live.clear()
        self.starting.clear()
        self.running.clear()

    def _lost_peer(self, error: MPI.Exception) -> None:
        """An MPI error: in fault-tolerant mode a lost peer, which fails every op of this set
        with PeerLostError and revokes every hvd_sgp communicator; otherwise it goes up."""
        if not recovery.is_failure(error):
            raise error
        lost = recovery.lost(f"a peer was lost during a Horovod collective{self._where()} "
                             f"({error.Get_error_string()})")
        self._break(str(lost), notify=False, error=PeerLostError)

    def _broken_error(self) -> HorovodInternalError:
        return self.broken_error(self.broken)

    # --- messages ---------------------------------------------------------------------------
    def _where(self) -> str:
        return "" if self.set_id == 0 else f" on process set {self.set_id}"

    def rank_list(self, set_ranks: Iterable[int]) -> str:
        """Set ranks named as global ranks: 'rank 3' or 'ranks 1, 2'."""
        names = sorted(self.ranks[r] for r in set_ranks)
        return ("rank " if len(names) == 1 else "ranks ") + ", ".join(map(str, names))

    def disagreement(self, values: dict[int, Any]) -> str:
        """'rank 0: a; ranks 1, 2: b' for values by set rank."""
        groups: dict[str, list[int]] = {}
        for r in sorted(values):
            groups.setdefault(str(values[r]), []).append(r)
        return "; ".join(f"{self.rank_list(rs)}: {v}" for v, rs in groups.items())

    def close(self) -> None:
        """Free the communicator (the set was removed or the layer shut down); ops still in
        flight fail."""
        self._break(f"process set {self.set_id} was removed or hvd_sgp was shut down",
                    notify=False, error=HorovodInternalError)
        self.closed = True
        untrack(self.comm)
        recovery.free(self.comm)


JOIN = "join"  # the name (and kind) of join's request

# --- every controller of this process, and waiting on them --------------------------------
_lock = threading.RLock()
controllers: dict[int, Controller] = {}  # by process-set id, for the sets this rank is in


def progress_all() -> bool:
    """One non-blocking pass over every controller; True when something moved."""
    with _lock:
        moved = False
        for ctl in list(controllers.values()):
            moved |= ctl.progress()
        return moved


def wait_until(done: Callable[[], bool]) -> None:
    """Drive progress until ``done()``: poll back to back while something moved within
    SPIN_SECONDS -- DATA_SPIN_SECONDS while a data phase runs: every rank has agreed on it,
    so it ends soon, and MPI moves a large message only while polled -- then sleep with a
    doubling pause (past MAX_PAUSE_SECONDS only in a long quiet wait: a rank blocked for
    seconds by a late peer leaves the core to others). Polls yield the core when this host
    has more ranks than cores (the peer may be waiting for it). The controllers' deadlines
    end every wait."""
    quiet_since, pause = time.monotonic(), 0.0
    while True:
        with _lock:
            moved = progress_all()
            if done():
                return
            moving_data = any(c.starting or c.running for c in controllers.values())
        now = time.monotonic()
        if moved:
            pause, quiet_since = 0.0, now
        elif now - quiet_since < (DATA_SPIN_SECONDS if moving_data else SPIN_SECONDS):
            if _crowded[0]:
                os.sched_yield()
        else:
            cap = min(max(MAX_PAUSE_SECONDS, (now - quiet_since) / 20), LONG_PAUSE_SECONDS)
            pause = min(max(pause * 2, 5e-5), cap)
            time.sleep(pause)


_crowded = [False]


def set_crowded(crowded: bool) -> None:
    """Whether this host runs more ranks than it has cores (set where the layer starts)."""
    _crowded[0] = crowded


def lock() -> threading.RLock:
    """The lock every submission and progress pass holds (one thread drives MPI at a time)."""
    return _lock


# --- the run-time timeline (hvd.start_timeline) --------------------------------------------
class TimelineRecorder:
    """Draws negotiations and data phases on a telemetry.Timeline, Horovod's event names."""

    def __init__(self, timeline: Any, mark_cycles: bool):
        self.timeline, self.mark_cycles = timeline, mark_cycles

    def negotiated(self, op: Operation, response: Response) -> None:
        now = self.timeline.now_us()
        kind = op.request.kind.upper()
        self.timeline.event(f"NEGOTIATE_{kind}", now - (time.monotonic() - op.submitted) * 1e6,
                            now, tensor=op.request.name, error=response.error)
        if self.mark_cycles:
            self.timeline.event("CYCLE_START", now, now)

    def moved(self, op: Operation) -> None:
        now = self.timeline.now_us()
        self.timeline.event(op.request.kind.upper(), now - (time.monotonic() - op.started) * 1e6,
                            now, tensor=op.request.name)


_timeline: Optional[TimelineRecorder] = None


def set_timeline(recorder: Optional[TimelineRecorder]) -> None:
    global _timeline
    _timeline = recorder


def active_timeline() -> Optional[TimelineRecorder]:
    return _timeline
