"""MPI start-up and the rank layout: world, node-local and cross-node communicators; in
fault-tolerant mode, the world's repair after a lost rank.

A node is the set of ranks that share memory (an MPI shared-memory split); SGP gossips between
nodes and averages exactly inside one. ``HVD_SGP_LOCAL_SIZE=L`` groups consecutive ranks into
nodes of L ranks instead, so one machine can emulate several nodes.

After a repair (``repair``) the world holds the survivors, ``rank()``/``size()`` report the new
world, and whatever built communicators of its own from the old one rebuilds them in a
callback registered with ``on_world_change``. With HVD_SGP_MAX_NP the repair then grows the
world back with spawned replacements (``_grow``); a replacement's ``init()`` is its side of
that (``_arrive``).
"""
from __future__ import annotations

import atexit
import functools
import math
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hvd_sgp.common import discovery, errors, fault_record, options, recovery, watchdog
from hvd_sgp.common.errors import (NotInitializedError, OptionError, PeerLostError,
                                   PeerTimeoutError, SgpError, SgpValueError)
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.watchdog import watched


@dataclass(frozen=True)
class Launcher:
    """Who started this process, as far as the environment tells."""

    name: str  # "openmpi", "mpich", "slurm", "horovodrun" or "none"
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int]


_LAUNCHER_VARS = (
    # (name, rank, size, local rank); first match wins, horovodrun sets its own on top of mpirun's.
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def detect_launcher(environ: Optional[dict] = None) -> Launcher:
    """Name the launcher from its environment variables (diagnostics and sgprun)."""
    env = os.environ if environ is None else environ

    def read(key: str) -> Optional[int]:
        value = env.get(key)
        return int(value) if value is not None and value.strip().isdigit() else None

    for name, rank_key, size_key, local_key in _LAUNCHER_VARS:
        if rank_key in env:
            return Launcher(name, read(rank_key), read(size_key), read(local_key))
    return Launcher("none", None, None, None)


class _State:
    def __init__(self, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm, thread_level: int,
                 node: Any, origin: int, entries: list, host: str):
        self.world, self.local, self.cross = watched(world), watched(local), watched(cross)
        self.thread_level = thread_level
        self.origin = origin  # the rank at init (a replacement's: new): names a rank for good
        self.node = node  # what makes ranks one node: HVD_SGP_LOCAL_SIZE group or host name
        self.host = host  # the host as the launcher names it (see _host)
        self.replacement = False  # spawned by a repair to replace a lost rank (_arrive)
        # Host discovery (sgprun --host-discovery-script), alike on every rank: the hosts the
        # world is laid out for, a change agreed at a commit and not yet applied (resize), and
        # the hosts the MPI runtime knows (others are added when a rank is spawned there).
        self.discovered: Optional[list] = None
        self.pending: Optional[list] = None
        self.allocated: set = set()
        self.remember(entries)

    def remember(self, entries: list) -> None:
        """Every rank's (origin, node, host), by current rank: what a repair needs to know of
        the ranks it lost (their slots, nodes and hosts) to put replacements there."""
        self.origins = [origin for origin, _, _ in entries]
        self.nodes = [node for _, node, _ in entries]
        self.hosts = [host for _, _, host in entries]
        self.next_origin = max(getattr(self, "next_origin", 0), max(self.origins) + 1)


_state: Optional[_State] = None
_lock = threading.Lock()  # the watchdog thread reads the world while a repair replaces it
_tracked: list = []  # private communicators derived from the world (the transports')


def _local_split(world: MPI.Comm) -> tuple[MPI.Comm, Any]:
    """The node-local communicator, and the key that names this rank's node."""
    local_size = options.from_environment("local_size")
    if local_size is None:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        return local, MPI.Get_processor_name()
    if world.Get_size() % local_size:
        raise OptionError(f"HVD_SGP_LOCAL_SIZE={local_size} must divide the number of ranks "
                            f"({world.Get_size()})")
    node = world.Get_rank() // local_size
    return world.Split(node, key=world.Get_rank()), node


def init(comm: Optional[MPI.Comm] = None) -> None:
    """Start MPI (thread level MULTIPLE requested) and build the communicators; idempotent.

    ``comm`` restricts hvd_sgp to a sub-communicator, as Horovod's ``init(comm=...)`` does.
    """
    global _state
    if _state is not None:
        return
    guarded = _join_guard()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    parent = MPI.Comm.Get_parent() if comm is None else MPI.COMM_NULL
    if parent != MPI.COMM_NULL:  # a replacement, spawned by the survivors' repair
        _state = _arrive(parent)
        if guarded:
            signal.alarm(0)
    else:
        world = (MPI.COMM_WORLD if comm is None else comm).Dup()
        discovered = _discovered_at_launch()
        local, node = _local_split(world)
        parts = _layout(world, local)
        host = (MPI.Get_processor_name() if discovered is None else
                discovery.assign(discovered, world.Get_size())[world.Get_rank()])
        entries = [(r, n, h) for r, (n, h) in enumerate(world.allgather((node, host)))]
        _state = _State(world, local, parts.cross, MPI.Query_thread(), node, world.Get_rank(),
                        entries, host)
        if discovered is not None:
            _state.discovered = discovered
            _state.allocated = {name for name, _ in discovered}
    recovery.configure(_world_revoked, revoke_all, _state.origin)
    watchdog.start(_state.world, _state.origins, float(options.from_environment("timeout")),
                   _state.thread_level >= MPI.THREAD_MULTIPLE)
    _abort_on_uncaught_errors()


def _discovered_at_launch() -> Optional[list]:
    """The hosts sgprun's discovery script found (HVD_SGP_DISCOVERED_HOSTS), or None without
    host discovery. A rank's host is then the one ``mpirun -H ... --map-by slot`` put it on
    (discovery.assign), as the script names it."""
    text = os.environ.get(discovery.VARIABLE, "").strip()
    if not text:
        if options.from_environment("host_discovery_script"):
            raise OptionError("HVD_SGP_HOST_DISCOVERY_SCRIPT is set, but the hosts were not "
                              "discovered at launch: start the job with 'sgprun "
                              "--host-discovery-script SCRIPT ...'")
        return None
    try:
        return discovery.decode(text)
    except discovery.DiscoveryError as error:
        raise OptionError(str(error)) from None


@dataclass(frozen=True)
class Layout:
    """A group of ranks as SGP sees it: all of them, this rank's node, and the ranks with this
    local rank on every node (the whole world, or a Horovod process set's ranks)."""

    world: MPI.Comm
    local: MPI.Comm
    cross: MPI.Comm


def split(world: MPI.Comm) -> Layout:
    """Nodes and cross-node groups of ``world`` (collective over it; ``world`` is kept)."""
    return _layout(world, _local_split(world)[0])


def _layout(world: MPI.Comm, local: MPI.Comm) -> Layout:
    cross = world.Split(local.Get_rank(), key=world.Get_rank())
    sizes = world.allgather(local.Get_size())
    if len(set(sizes)) != 1:
        raise SgpValueError(
            f"nodes have different numbers of ranks {sorted(set(sizes))}; hvd_sgp needs the same "
            "number of ranks on every node (or set HVD_SGP_LOCAL_SIZE)"
        )
    return Layout(world, local, cross)


def layout() -> Layout:
    """The world's layout."""
    state = _require()
    return Layout(state.world, state.local, state.cross)


def shutdown() -> None:
    """Release the communicators; a later init() starts afresh. MPI itself ends at exit."""
    global _state
    if _state is None:
        return
    with _lock:
        comms, _state = (_state.cross, _state.local, _state.world), None
    watchdog.stop()
    for comm in comms:
        recovery.free(comm)


atexit.register(shutdown)
errors.name_ranks_by(lambda: _state.world.Get_rank() if _state is not None else None)


def is_initialized() -> bool:
    return _state is not None


def _require() -> _State:
    if _state is None:
        raise NotInitializedError()
    return _state


def world_comm() -> MPI.Comm:
    return _require().world


def local_comm() -> MPI.Comm:
    return _require().local


def cross_comm() -> MPI.Comm:
    return _require().cross


def rank() -> int:
    return _require().world.Get_rank()


def origin_rank() -> int:
    """This rank's rank at init(): how logs and errors name it across repairs."""
    return _require().origin


def size() -> int:
    return _require().world.Get_size()


def host() -> str:
    """This rank's host as the launcher names it: the discovery script's name with host
    discovery, MPI's processor name otherwise."""
    return _require().host


def replacement() -> bool:
    """Whether this process was spawned to replace a lost rank (HVD_SGP_MAX_NP): it joined
    survivors that are inside hvd.elastic.run, at their ``state.sync()``."""
    return _require().replacement


def local_rank() -> int:
    return _require().local.Get_rank()


def local_size() -> int:
    return _require().local.Get_size()


def cross_rank() -> int:
    return _require().cross.Get_rank()


def cross_size() -> int:
    return _require().cross.Get_size()


def mpi_threads_supported() -> bool:
    """True when MPI granted THREAD_MULTIPLE (needed for overlapped gossip)."""
    return _require().thread_level >= MPI.THREAD_MULTIPLE


def mpi_library() -> str:
    """The MPI implementation's own version line."""
    return MPI.Get_library_version().strip().splitlines()[0]


def cuda_aware_mpi() -> bool:
    """Whether MPI can take CUDA buffers directly.

    ``HVD_SGP_CUDA_AWARE=0/1`` decides when set; otherwise the loaded MPI library is asked at
    run time (Open MPI's ``MPIX_Query_cuda_support``). An MPI without that query (MPICH) counts
    as not CUDA-aware: CUDA tensors are then staged through host memory.
    """
    forced = os.environ.get("HVD_SGP_CUDA_AWARE")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    return _mpi_reports_cuda()


@functools.cache
def _mpi_reports_cuda() -> bool:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    except OSError:
        return False
    for path in sorted(libraries):
        try:
            return bool(ctypes.CDLL(path).MPIX_Query_cuda_support())
        except (OSError, AttributeError):
            continue
    return False


def _abort_on_uncaught_errors() -> None:
    """An exception escaping one rank ends the whole job (MPI_Abort) instead of leaving its
    peers blocked forever and the rank itself stuck in MPI_Finalize at exit. In fault-tolerant
    mode only this rank leaves (exit 1, no MPI_Finalize) and the others repair without it."""
    previous = sys.excepthook
    if getattr(previous, "hvd_sgp_abort", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        if recovery.enabled():
            recovery.leave()
        if not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            watchdog.announce(f"raised {kind.__name__}: {value}")  # every rank says why
            MPI.COMM_WORLD.Abort(1)

    hook.hvd_sgp_abort = True
    sys.excepthook = hook


# --- fault tolerance: the world's repair ------------------------------------------------------
@dataclass(frozen=True)
class WorldChange:
    """What a repair hands every ``on_world_change`` subscriber."""

    world: MPI.Comm  # the survivors (also runtime.world_comm() from now on)
    local: MPI.Comm  # this rank's node, re-formed (see _regroup)
    cross: MPI.Comm  # the same local rank of every node
    lost: tuple  # the ranks gone, named by their rank at init (origin_rank)
    size_before: int
    realign: bool  # repaired inside a step: optimizers realign their steps (see engine)
    joined: tuple = ()  # replacements taken in (their origins); nothing was lost then

    @property
    def ranks(self) -> list:
        """The replacements' ranks in the new world."""
        origins = _require().origins
        return [origins.index(origin) for origin in self.joined]


_subscribers: dict = {}  # key -> weak reference to the callback, in registration order
_next_key = [0]


def on_world_change(callback: Callable[[WorldChange], None]) -> int:
    """Call ``callback(change)`` after every repair, with the new communicators; returns a key
    for ``forget_world_change``. Bound methods are held weakly.

    The subscriber contract: the old communicators are revoked and freed, so drop every request
    in flight on them without waiting and build your own communicators from ``change`` again
    (collectively: every survivor calls the subscribers alive on all of them, in registration
    order); raise PeerLostError if communication fails (the repair then starts over and calls
    you again, so be idempotent). Register at the same point on every rank.
    """
    key = _next_key[0]
    _next_key[0] += 1
    _subscribers[key] = (weakref.WeakMethod(callback) if hasattr(callback, "__self__")
                         else (lambda: callback))
    return key


def forget_world_change(key: int) -> None:
    _subscribers.pop(key, None)


def track(comm: MPI.Comm) -> None:
    """A private communicator derived from the world: revoked with it when a peer is lost."""
    _tracked.append(comm)


def untrack(comm: MPI.Comm) -> None:
    if comm in _tracked:
        _tracked.remove(comm)


def revoke_all() -> None:
    """Revoke the world, node and cross communicators and every tracked one, so every rank
    blocked on any of them learns of the failure (ULFM's MPI_Comm_revoke)."""
    with _lock:
        if _state is None:
            return
        comms = [_state.world, _state.local, _state.cross, *_tracked]
    for comm in comms:
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except MPI.Exception:
            pass


def _world_revoked() -> bool:
    with _lock:
        return _state is not None and _state.world.Is_revoked()


def repair(realign: bool = True) -> WorldChange:
    """Repair the world in place after a lost rank (fault-tolerant mode); every survivor calls
    it, from wherever it noticed the failure.

    1. Revoke every hvd_sgp communicator (late ranks learn at their next MPI call).
    2. Shrink the world to its survivors (ULFM's agreement inside MPI_Comm_shrink gives every
       survivor the same communicator); the lost ranks are the difference.
    3. Re-form the nodes and the cross-node communicators (``_regroup``).
    4. Call the ``on_world_change`` subscribers (optimizers rebuild their graph and fold their
       PushSum state).
    5. With HVD_SGP_MAX_NP (or host discovery), outside a step (``realign`` False:
       hvd.elastic.run's repair, the step boundary where Horovod adds hosts), spawn
       replacements and take them in (``_grow``); not while a change of hosts waits, whose
       ``resize`` places the newcomers. A failure during 2-5 starts over at 1.
    Fewer survivors than HVD_SGP_MIN_NP end the job with an SgpError on every survivor.
    """
    state = _require()
    began = time.monotonic()
    deadline = began + recovery.repair_deadline()
    seats = _seats(state)  # the world as it was: names the lost, places their replacements
    known = set(state.origins)
    attempts = 0  # spawns tried: an MPI that keeps failing them leaves the world smaller
    grown = None
    with recovery.repairing(deadline):
        while True:
            revoke_all()
            try:
                with recovery.translated("the repair of the world"):
                    change = _rebuild(state, known, realign)
                    survivors = change.world.Get_size()
                    _notify(change)
                    if (not realign and attempts < 3 and state.pending is None
                            and _missing(state) > 0):
                        attempts += 1
                        grown = _grow(state, _plan(state, seats), known, seats)
                break
            except PeerLostError as error:
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"the world could not be repaired within "
                                           f"{recovery.repair_deadline():.0f} s") from None
                if state.world.Get_rank() == 0:
                    print(f"hvd_sgp: the repair starts over: {error}", file=sys.stderr,
                          flush=True)
    lost = sorted(known - set(state.origins))
    fault_record.write("lost " + ",".join(map(str, lost)), state.origin)
    if grown is not None:
        fault_record.write("joined " + ",".join(map(str, grown.joined)), state.origin)
    if state.world.Get_rank() == 0:
        joined = (f"; {len(grown.joined)} replacement(s) joined (rank(s) "
                  f"{sorted(grown.ranks)}): back to {state.world.Get_size()} ranks"
                  if grown is not None else "")
        print(f"hvd_sgp: lost rank(s) {lost}; {survivors} of "
              f"{change.size_before} ranks go on{joined} after a repair of "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
        if realign and _missing(state) > 0 and not _said[0]:
            _said[0] = True
            print("hvd_sgp: HVD_SGP_MAX_NP replaces lost ranks only under hvd.elastic.run "
                  "(a replacement joins at its state.sync()); this script repairs inside "
                  "the optimizer's step, so it goes on with fewer ranks",
                  file=sys.stderr, flush=True)
    return grown or change


_said = [False]  # the plain-script note on HVD_SGP_MAX_NP, printed once


def _rebuild(state: _State, known: set, realign: bool) -> WorldChange:
    size_before = state.world.Get_size()
    survivors = state.world.Shrink()  # (Ishrink fails on a revoked world in Open MPI 5.0)
    entries = survivors.allgather((state.origin, state.node, state.host))
    known.update(state.origins)  # replacements taken in by an attempt that failed later
    lost = tuple(sorted(known - {origin for origin, _, _ in entries}))
    minimum = options.from_environment("min_np")
    if survivors.Get_size() < minimum:
        raise SgpError(f"only {survivors.Get_size()} ranks survive (lost {list(lost)}), fewer "
                       f"than HVD_SGP_MIN_NP={minimum}: the job ends")
    if state.discovered is not None:  # a failure may have cut a change of hosts short
        state.discovered, state.pending, state.allocated = survivors.bcast(
            (state.discovered, state.pending, state.allocated), root=0)
    local, cross = _regroup(survivors, [(origin, node) for origin, node, _ in entries])
    _install(state, survivors, local, cross, entries)
    return WorldChange(survivors, local, cross, lost, size_before, realign)


def _install(state: _State, world: MPI.Comm, local: MPI.Comm, cross: MPI.Comm,
             entries: list) -> None:
    with _lock:
        old = (state.world, state.local, state.cross)
        state.world, state.local, state.cross = watched(world), watched(local), watched(cross)
        state.remember(entries)
    for comm in old:
        recovery.free(comm)


# --- growing back: replacements for the lost ranks ------------------------------------------
def _target(state: _State) -> Optional[int]:
    """The world's size to grow back to: HVD_SGP_MAX_NP, and with host discovery at most the
    discovered slots (all of them without HVD_SGP_MAX_NP, as Horovod's); None: no growing."""
    target = options.from_environment("max_np")
    if state.discovered is not None:
        slots = discovery.total(state.discovered)
        target = slots if target is None else min(target, slots)
    return target


def _missing(state: _State) -> int:
    """How many ranks the world lacks to be its target size again (0 without one)."""
    target = _target(state)
    return 0 if target is None else max(0, target - state.world.Get_size())


def _seats(state: _State) -> dict:
    """origin -> (rank, node, host) of every rank of the world as it stands."""
    return {origin: (slot, node, host) for slot, (origin, node, host) in
            enumerate(zip(state.origins, state.nodes, state.hosts))}


def _plan(state: _State, seats: dict) -> dict:
    """Where the replacements go, worked out alike on every survivor: each takes a lost
    rank's seat (its rank, so ``hvd.rank()`` is the lost rank's again, and its node), lowest
    first, then new seats at the end; each gets a new origin (an origin names one process).
    Rank 0 stays a survivor's: hvd.elastic's ``state.sync()`` broadcasts rank 0's state, so
    when rank 0 was lost the lowest survivor moves there and its replacement takes that
    survivor's rank instead (on rank 0's node)."""
    alive = set(state.origins)
    slots = {origin: seats[origin][0] for origin in state.origins}
    vacant = sorted({seat for origin, seat in seats.items()
                     if origin not in alive and seat[0] not in slots.values()},
                    key=lambda seat: seat[0])
    vacant = list({seat[0]: seat for seat in vacant}.values())  # one per rank
    if vacant and vacant[0][0] == 0:
        first = min(slots, key=slots.get)
        vacant[0] = (slots[first],) + vacant[0][1:]
        slots[first] = 0
        vacant.sort(key=lambda seat: seat[0])
    top = max(seat[0] for seat in seats.values()) + 1
    missing = _missing(state)
    while len(vacant) < missing:
        vacant.append((top, None, None))
        top += 1
    local_size = options.from_environment("local_size")
    newcomers = []
    for index, (slot, node, host) in enumerate(vacant[:missing]):
        if local_size is None:
            node = None  # a node is a host: the replacement's own, wherever it starts
        elif node is None:
            node = slot // local_size
        newcomers.append((state.next_origin + index, slot, node, host))
    slots.update({origin: slot for origin, slot, _, _ in newcomers})
    return {"survivors": len(state.origins), "newcomers": newcomers, "slots": slots,
            "next_origin": state.next_origin + len(newcomers)}


def _spawn_infos(state: _State, hosts: list) -> list:
    """Where each new process starts (one MPI_Info per process): on the lost rank's host, in
    its place (the dead process's slot is not freed by Open MPI's runtime, hence the
    oversubscription), or on a host the discovery script named. A discovered host the runtime
    does not know yet is added to its allocation once (PMIX_ADD_HOST, with the host's
    discovered slots: PRRTE starts a daemon there). The mapping policy is one directive for
    the whole spawn: Open MPI 5.0 refuses it repeated in a second MPI_Info ("conflicting
    directives"), so only the first carries it."""
    infos, adding = [], set()
    for index, host in enumerate(hosts):
        info = MPI.Info.Create()
        if index == 0:
            info.Set("map_by", ":OVERSUBSCRIBE")
        info.Set("wdir", os.getcwd())
        if host is not None:
            info.Set("host", host)
            if (state.discovered is not None and host not in state.allocated
                    and host not in adding):
                adding.add(host)
                info.Set("PMIX_ADD_HOST", f"{host}:{dict(state.discovered).get(host, 1)}")
        infos.append(info)
    return infos


def _grow(state: _State, plan: dict, known: set, seats: dict) -> Optional[WorldChange]:
    """Spawn replacements for the lost ranks (MPI_Comm_spawn_multiple from the survivors, the
    same program and arguments, one process per lost rank's host) and merge them in. The
    replacement's side is ``_arrive``: both end in ``_settle``. The subscribers are called
    with ``joined`` set and must not communicate for it (the replacements have none yet):
    an optimizer puts its engine aside, to start again with the replacements' own engines at
    the same point of the training function (see engine.retire). An MPI that cannot spawn
    (no slot, no such host) leaves the world as the shrink made it, with a warning. ``plan``:
    who goes where (``_plan`` after a failure, ``_resize_plan`` after a change of hosts)."""
    count = len(plan["newcomers"])
    infos = _spawn_infos(state, [host for _, _, _, host in plan["newcomers"]])
    with recovery.spawning():
        try:
            inter = state.world.Spawn_multiple([sys.executable] * count,
                                               [sys.orig_argv[1:]] * count, [1] * count, infos,
                                               root=0)
        except MPI.Exception as error:
            if recovery.is_failure(error):
                raise
            if state.world.Get_rank() == 0:
                print(f"hvd_sgp: could not start {count} new process(es) "
                      f"({error.Get_error_string()}); {state.world.Get_size()} ranks go on",
                      file=sys.stderr, flush=True)
            return None
        finally:
            for info in infos:
                info.Free()
        track(inter)
        try:
            merged = inter.Merge(high=False)
        finally:
            untrack(inter)
            inter.Disconnect()  # (with the replacements' parent.Disconnect(): see _arrive)
    size_before = state.world.Get_size()
    state.allocated |= {host for _, _, _, host in plan["newcomers"] if host is not None}
    merged.bcast(dict(plan, hosts=(state.discovered, state.allocated)), root=0)
    world, local, cross, entries = _settle(merged, plan, state.origin, state.node, state.host)
    _install(state, world, local, cross, entries)
    joined = tuple(origin for origin, _, _, _ in plan["newcomers"])
    known.update(joined)
    seats.update({origin: (plan["slots"][origin], node, host)  # (a later attempt's plan)
                  for origin, node, host in entries})
    change = WorldChange(world, local, cross, (), size_before, False, joined)
    _notify(change)
    return change


# --- host discovery: the world follows the discovered hosts ---------------------------------
def discovering() -> bool:
    """Whether the job runs with host discovery (sgprun --host-discovery-script)."""
    return _require().discovered is not None


def hosts_changed(latest: Optional[list]) -> int:
    """Compare the hosts the discovery script printed last (rank 0's, the same on every rank:
    hvd.elastic's commit broadcasts them) with those the world is laid out for. A change that
    moves no rank (slots beyond HVD_SGP_MAX_NP, a host without ranks gone) is taken silently;
    any other waits as ``pending`` for ``resize``. Returns discovery.ADDED when ranks will
    join and REMOVED when ranks will leave (Horovod's HostUpdateResult, which flags hosts; here
    the ranks that move decide, so that ``skip_sync`` never skips a newcomer's sync), 0 for no
    change."""
    state = _require()
    if latest is None or state.discovered is None:
        return 0
    latest = discovery.merged_order(state.discovered, latest)
    if latest == state.discovered:
        return 0
    plan = _resize_plan(state, latest)
    change = ((discovery.ADDED if plan["newcomers"] else 0)
              | (discovery.REMOVED if plan["leaving"] else 0))
    if change:
        state.pending = latest
    else:
        state.discovered = latest
    return change


def resize_pending() -> bool:
    """A change of hosts was agreed at a commit and the world is not laid out for it yet."""
    return _require().pending is not None


def resize() -> bool:
    """Lay the world out for the agreed new hosts (``pending``); every rank calls it, between
    two calls of the training function (hvd.elastic.run, after HostsUpdatedInterrupt). Returns
    True on a rank that must leave: its host is gone or has fewer slots now (the highest ranks
    of a host leave first); it takes part in the split and nothing after.

    1. The world splits into the ranks that stay (rank order kept, so rank 0 stays rank 0
       unless its host went) and those that leave; nodes are re-formed.
    2. The ``on_world_change`` subscribers are called as after a failure: optimizers fold
       their PushSum state into the exact average of the ranks that stay, weight 1 each (the
       leaving ranks' share goes with them, as a lost rank's does).
    3. Newcomers are spawned on the hosts with free slots, in host order, up to
       HVD_SGP_MAX_NP, and seated after the ranks that stay (``_grow``); they join at
       hvd.elastic's ``state.sync()``, as replacements do.
    Fewer ranks than HVD_SGP_MIN_NP end the job with an SgpError on every rank. A lost rank
    during the change raises PeerLostError; after the repair, ``resize`` is called again and
    works out what is left to do from the world as it then is.
    """
    state = _require()
    began = time.monotonic()
    plan = _resize_plan(state, state.pending)
    keep = len(plan["slots"]) - len(plan["newcomers"])
    minimum = options.from_environment("min_np")
    if keep + len(plan["newcomers"]) < minimum:
        raise SgpError(f"the discovered hosts {discovery.encode(state.pending)} give "
                       f"{keep + len(plan['newcomers'])} ranks, fewer than "
                       f"HVD_SGP_MIN_NP={minimum}: the job ends")
    leaving = state.origin in plan["leaving"]
    grown = None
    with recovery.repairing(began + recovery.repair_deadline()):
        with recovery.translated("the change of hosts"):
            world = state.world.Split(MPI.UNDEFINED if leaving else 0, key=state.world.Get_rank())
            if leaving:
                return True
            size_before = state.world.Get_size()
            entries = world.allgather((state.origin, state.node, state.host))
            local, cross = _regroup(world, [(origin, node) for origin, node, _ in entries])
            _install(state, world, local, cross, entries)
            _notify(WorldChange(world, local, cross, tuple(plan["leaving"]), size_before, False))
            state.discovered = state.pending
            if plan["newcomers"]:
                known = set(state.origins)
                grown = _grow(state, plan, known, _seats(state))
            state.pending = None
    if grown is not None:
        fault_record.write("joined " + ",".join(map(str, grown.joined)), state.origin)
    if state.world.Get_rank() == 0:
        left = f"rank(s) {plan['leaving']} left" if plan["leaving"] else "no rank left"
        where = sorted({host for *_, host in plan["newcomers"]})
        added = (f"{len(grown.joined)} rank(s) joined on {where}" if grown is not None
                 else "no rank joined")
        print(f"hvd_sgp: hosts changed to {discovery.encode(state.discovered)}: {left}, "
              f"{added}; {state.world.Get_size()} ranks go on after "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
    return False


def _resize_plan(state: _State, hosts: list) -> dict:
    """Who stays, who leaves and where newcomers go for ``hosts``, alike on every rank: a rank
    stays while its host has a slot for it (lowest ranks first); the free slots then take
    newcomers, host by host, until HVD_SGP_MAX_NP. Ranks that stay keep their order and come
    first (rank 0 stays a rank that holds the state ``state.sync()`` sends); newcomers follow.
    Ranks are named by origin (launch rank), as in ``_plan``."""
    room = dict(hosts)
    stay, leaving = [], []
    for origin, host in zip(state.origins, state.hosts):
        if room.get(host, 0) > 0:
            room[host] -= 1
            stay.append(origin)
        else:
            leaving.append(origin)
    limit = options.from_environment("max_np")
    free = sum(room.values()) if limit is None else min(sum(room.values()), limit - len(stay))
    local_size = options.from_environment("local_size")
    places = [name for name, _ in hosts for _ in range(room[name])][:max(0, free)]
    newcomers = []
    for index, host in enumerate(places):
        slot = len(stay) + index
        node = None if local_size is None else slot // local_size
        newcomers.append((state.next_origin + index, slot, node, host))
    slots = {origin: slot for slot, origin in enumerate(stay)}
    slots.update({origin: slot for origin, slot, _, _ in newcomers})
    return {"survivors": len(stay), "newcomers": newcomers, "slots": slots,
            "leaving": leaving, "next_origin": state.next_origin + len(newcomers)}


def _settle(merged: MPI.Comm, plan: dict, origin: int, node: Any,
            host: str) -> tuple[MPI.Comm, MPI.Comm, MPI.Comm, list]:
    """Survivors and replacements alike: order the merged world by seat, and form its nodes."""
    track(merged)
    try:
        world = merged.Split(0, key=plan["slots"][origin])
    finally:
        untrack(merged)
        recovery.free(merged)
    entries = world.allgather((origin, node, host))
    local, cross = _regroup(world, [(o, n) for o, n, _ in entries])
    return world, local, cross, entries


def _join_guard() -> bool:
    """On a process spawned by a grow (Open MPI sets OMPI_PARENT_PORT before MPI starts), in
    fault-tolerant mode: an alarm that ends it (SIGALRM, default action) when MPI_Init and the
    join (``_arrive``) have not completed within the repair's deadline. MPI_Init never returns
    when a survivor dies during the spawn, and holds the GIL: a Python timer could not act."""
    if "OMPI_PARENT_PORT" not in os.environ or not options.from_environment("fault_tolerant"):
        return False
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(int(recovery.repair_deadline()))
    return True


def _arrive(parent: MPI.Comm) -> _State:
    """A replacement's init(): merge with the survivors that spawned it, take the seat their
    plan gives (``_grow``), and form the nodes with them. A failure on the way (a survivor
    lost meanwhile) ends this process, and the survivors repair without it; so does a join
    that has not completed within the repair's deadline (``_join_guard``)."""
    try:
        parent.Set_errhandler(MPI.ERRORS_RETURN)
        merged = parent.Merge(high=True)
        # Disconnected, not kept: a parent intercommunicator still held at exit makes MPI_Finalize
        # wait forever to disconnect from survivors that no longer hold theirs (the exit alarm
        # then killed the replacement, and PRRTE 3.0 reported the spawned job's abnormal end as
        # "LAUNCHER JOB OBJECT NOT FOUND", its parent job being gone).
        parent.Disconnect()
        plan = merged.bcast(None, root=0)
        origin, _, node, host = plan["newcomers"][merged.Get_rank() - plan["survivors"]]
        node = MPI.Get_processor_name() if node is None else node
        host = MPI.Get_processor_name() if host is None else host
        world, local, cross, entries = _settle(merged, plan, origin, node, host)
    except MPI.Exception as error:
        recovery.exclude_self(f"this replacement could not join the job "
                              f"({error.Get_error_string()})")
    state = _State(world, local, cross, MPI.Query_thread(), node, origin, entries, host)
    state.discovered, state.allocated = plan["hosts"]
    state.next_origin = plan["next_origin"]
    state.replacement = True
    recovery.arrived()
    return state


def _regroup(world: MPI.Comm, entries: list) -> tuple[MPI.Comm, MPI.Comm]:
    """Nodes of the survivors: each node keeps its surviving ranks, cut into groups of the
    largest size that divides every node (SGP's shards need the same number of ranks on every
    node), so a node that lost one of two ranks makes every rank its own node."""
    nodes: dict = {}
    for r, (_, node) in enumerate(entries):
        nodes.setdefault(node, []).append(r)
    group = math.gcd(*(len(members) for members in nodes.values()))
    me = world.Get_rank()
    widest = max(len(members) for members in nodes.values())
    color = next(index * widest + members.index(me) // group
                 for index, members in enumerate(sorted(nodes.values()))
                 if me in members)
    local = world.Split(color, key=me)
    return local, world.Split(local.Get_rank(), key=me)


def _notify(change: WorldChange) -> None:
    alive = []
    for key, ref in list(_subscribers.items()):
        callback = ref()
        if callback is None:
            _subscribers.pop(key)
        else:
            alive.append((key, callback))
    if change.joined:  # the replacements have no subscribers; the survivors agreed just now
        everywhere = {key for key, _ in alive}
    else:
        everywhere = set.intersection(*(set(keys) for keys in
                                        change.world.allgather([key for key, _ in alive])))
    for key, callback in alive:
        if key in everywhere:
            callback(change)
        else:  # collected on some rank: gone for good
            _subscribers.pop(key, None)
    if change.joined:
        _renumber()


def _renumber() -> None:
    """After replacements joined: the keys that remain (the optimizers' engines retired) are
    numbered from 0, as a replacement numbers its own from init(), so that the subscribers
    registered from here on, in the same order everywhere, get the same keys everywhere
    (``_notify`` agrees on the keys)."""
    remaining = list(_subscribers.values())
    _subscribers.clear()
    _subscribers.update(enumerate(remaining))
    _next_key[0] = len(remaining)
