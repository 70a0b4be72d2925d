"""Warm spares (HVD_SGP_SPARES): processes started before they are needed, so that a grow
after a loss takes in one that has already imported its framework, instead of spawning one and
waiting while it starts (about 3 s of Python, torch and the first optimizer's imports here).

A spare is spawned by the whole world through ``python -m hvd_sgp.spare <the script>``,
which starts MPI before anything else: the spawn costs the world about 0.1 s, not the script's
imports. The spare opens a port, tells its spawners, and runs the script; its ``init()``
waits there (``wait``), polling its spawners, until one calls it up (``call``: it answers,
is told to go on, accepts the survivors' MPI_Comm_connect to its port, and they merge, as
with a spawned replacement's intercommunicator) or dismisses it (``dismiss``, at their
shutdown). A spare whose spawners are all gone, or whose launcher is, leaves. A stopped
spare is killed by the stopped-peer sentinel (stopped.py), as a stopped replacement is.

Every rank that spawned a spare keeps the intercommunicator to it: the lowest such rank calls
it up, and each learns there (Iprobe) that it died before anyone counts on it. Newcomers hold
none of the older spares; the pool is the same list on every rank, kept by the world's
collective calls (``replenish`` after init and after each grow, ``call`` in a grow).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from hvd_sgp.common import recovery, stopped
from hvd_sgp.common.mpi import MPI

# The messages between a spare and its spawners (tags; every message is empty): a spare
# says it is ready (its imports done) as it begins to wait; a spawner calls it up, the spare
# answers, and the caller tells it to go on to the accept or to go back to waiting (another
# spare did not answer); or a spawner dismisses it, and it says bye to every spawner as it
# leaves.
_CALL, _ANSWER, _GO, _RELEASE, _DISMISS, _BYE, _NEVER, _HELLO, _READY = (7117 + k
                                                                         for k in range(9))
_POLL = 0.02  # seconds between a waiting spare's looks at its spawners
_EMPTY = [b"", MPI.BYTE]


@dataclass
class Spare:
    """One spare, as the world knows it: where to connect, its host, and (on the ranks that
    spawned it) the intercommunicator to it."""

    port: str
    host: str
    process: stopped.Identity  # (for the stopped-peer sentinel: ULFM's detector does not watch it)
    inter: Optional[MPI.Intercomm] = None
    pending: list = field(default_factory=list)  # this rank's sends to it (``_tell``)
    ready: bool = False  # it said it waits, its imports done (``ready``; its spawners only)


_pool: list[Spare] = []  # this world's live spares, the same ports in the same order everywhere
_warm_ups: list[Callable[[], None]] = []  # the adapters' imports a waiting spare does ahead
_as_spare: dict = {}  # in a spare until it is called up: its parent, port, launcher, spawners


# --- the world's side -----------------------------------------------------------------------
def _command() -> tuple:
    """(interpreter options, the script and its arguments) this process was started with:
    ``python [OPTIONS] (SCRIPT | -m MODULE | -c COMMAND) ARGS``, or a spare's
    ``python [OPTIONS] -m hvd_sgp.spare ...`` with its own prefix dropped."""
    argv = list(sys.orig_argv[1:])
    for index in range(len(argv) - 1):
        if argv[index:index + 2] == ["-m", "hvd_sgp.spare"]:
            return argv[:index], argv[index + 2:]
    tail = len(sys.argv) - 1  # the script's own arguments end the command line
    start = len(argv) - tail - 1
    if start > 0 and argv[start - 1] in ("-m", "-c"):
        start -= 1
    return argv[:start], argv[start:]


def script_argv() -> list:
    """What a spawned replacement runs after the interpreter: this script, as started."""
    interpreter, script = _command()
    return interpreter + script


def replenish(comm: MPI.Comm, count: int, processes: list, hosts: tuple = ()) -> None:
    """Spawn spares until the pool holds ``count``; collective over ``comm`` (the world,
    right after init, a grow or a repair whose replacements join later, whose ranks'
    ``processes`` each spare is told: see ``_next_message``). The first spawned go to
    ``hosts`` (None: where MPI maps them). A spawn MPI refuses leaves the pool short, with a
    warning."""
    hosts = list(hosts)
    while len(_pool) < count:
        info = MPI.Info.Create()
        info.Set("map_by", ":OVERSUBSCRIBE")
        info.Set("wdir", os.getcwd())
        host = hosts.pop(0) if hosts else None
        if host is not None:
            info.Set("host", host)
        try:
            with recovery.spawning():
                interpreter, script = _command()
                inter = comm.Spawn(sys.executable, [*interpreter, "-m", "hvd_sgp.spare", *script],
                                   1, info, root=0)
        except MPI.Exception as error:
            if recovery.is_failure(error):
                raise
            if comm.Get_rank() == 0:
                print(f"hvd_sgp: could not start a spare ({error.Get_error_string()}); "
                      f"lost ranks will be replaced by spawning", file=sys.stderr, flush=True)
            return
        finally:
            info.Free()
        _pool.append(Spare(*inter.bcast(None, root=0), inter))
        inter.bcast(processes, root=MPI.ROOT if comm.Get_rank() == 0 else MPI.PROC_NULL)
        inter.Send(_EMPTY, dest=0, tag=_HELLO)  # (see _post)


def held() -> list:
    """The pool, to hand newcomers (they hold no intercommunicator to these spares)."""
    return [(spare.port, spare.host, spare.process) for spare in _pool]


def adopt(pool: list) -> None:
    """A newcomer learns the pool it joins (``held`` on the survivors)."""
    _pool[:] = [Spare(*spare) for spare in pool]


def peers() -> list:
    """(name, process) of every spare, for the stopped-peer sentinel."""
    return [("a warm spare", spare.process) for spare in _pool]


def usable(comm: MPI.Comm, hosts: list) -> list:
    """The spares to take in for newcomers bound for ``hosts`` (None: anywhere), as
    (spare, the rank that calls it up) pairs, or [] to spawn them all: too few live spares
    on those hosts. Collective over ``comm``: every rank that holds a spare looks whether it
    died (one allgather of a byte per spare), so every rank decides alike. A spare found
    dead, or held by no rank left (nobody can call it up; it leaves when its spawners are
    gone), leaves the pool."""
    if not _pool or len(hosts) > len(_pool):
        return []
    views = _gather(comm, [0 if spare.inter is None else 1 if _alive(spare.inter) else 2
                           for spare in _pool])  # (not held, alive, dead), by rank
    callers = {}
    for index, spare in enumerate(_pool):
        column = [view[index] for view in views]
        if 1 in column and 2 not in column:
            callers[spare.port] = column.index(1)
    _drop({spare.port for spare in _pool} - set(callers))
    found = _match(_pool, hosts)
    return [] if found is None else [(spare, callers[spare.port]) for spare in found]


def ready(comm: MPI.Comm, hosts: list, overdue: bool) -> bool:
    """Whether to take in replacements for ``hosts`` now (world_grow.replacements_ready): a
    live spare that said it is ready waits on each host, or waiting on cannot help (a spare
    died, none is on a host, or ``overdue`` on some rank: they are taken in, and the grow
    calls up or spawns as ever). Collective over ``comm``, with the same outcome on every
    rank (one allgather of a byte per spare)."""
    for spare in _pool:
        if spare.inter is not None and not spare.ready:
            spare.ready = _take(spare.inter, 0, _READY) is True
    views = _gather(comm, [0 if spare.inter is None else 2 if not _alive(spare.inter)
                           else 1 if spare.ready else 3 for spare in _pool] + [int(overdue)])
    columns = list(zip(*views))
    if any(columns[-1]) or any(2 in column for column in columns[:-1]):
        return True
    said = [spare for spare, column in zip(_pool, columns) if 1 in column]
    held = [spare for spare, column in zip(_pool, columns) if any(column)]
    return _match(said, hosts) is not None or _match(held, hosts) is None


def _match(candidates: list, hosts: list) -> Optional[list]:
    """A spare of its own among ``candidates`` for each of ``hosts`` (None: any host), in
    order, or None where a host has none."""
    free, chosen = list(candidates), []
    for host in hosts:
        match = next((s for s in free if host is None or s.host == host), None)
        if match is None:
            return None
        free.remove(match)
        chosen.append(match)
    return chosen


def call(comm: MPI.Comm, chosen: list, answer_seconds: float) -> Optional[MPI.Intracomm]:
    """Take the ``chosen`` spares in (``usable``'s pairs), collectively over the survivors
    (``comm``): each caller calls its spares up and waits ``answer_seconds`` at most for
    their answers (``_answers``); if all answered, they go on to accept and the survivors
    connect to each in turn and merge (the spares taken in before joining each later
    connect). Returns the merged world (survivors first, then the spares in order), as a
    spawn's merge does; or None, every spare that answered sent back to waiting, where one
    did not (it leaves the pool): the grow then spawns. Once told to go, a spare that dies
    before its accept leaves the connect waiting until the repair's deadline (a window of a
    poll, 20 ms)."""
    me = comm.Get_rank()
    mine = [spare for spare, caller in chosen if caller == me]
    answered = _answers(comm, mine, answer_seconds)
    views = _gather(comm, [int(spare in mine and spare not in answered) for spare, _ in chosen])
    silent = {spare.port for index, (spare, _) in enumerate(chosen)
              if any(view[index] for view in views)}
    for spare in answered:
        _tell(spare, _RELEASE if silent else _GO)
    _drop(silent)
    if silent:
        return None
    ports = [spare.port for spare, _ in chosen]
    try:
        lobby = comm
        for index, port in enumerate(ports):
            lobby, _ = _connect(lobby, port, comm, ports[index + 1:])
        return lobby
    finally:
        _drop(set(ports))


def _gather(comm: MPI.Comm, values: list) -> list:
    """Every rank's ``values`` (small ints, as many on every rank), by rank: one MPI
    Allgather of bytes. Not a pickled allgather: cut short by a death inside a grow, one
    returned bytes that failed to unpickle (UnpicklingError, not a lost peer) in a chaos run."""
    mine = np.array(values, dtype=np.uint8)
    out = np.empty(comm.Get_size() * len(values), dtype=np.uint8)
    comm.Allgather(mine, out)
    return out.reshape(comm.Get_size(), len(values)).tolist()


def _answers(comm: MPI.Comm, spares: list, seconds: float) -> list:
    """Call ``spares`` up and return those that answered within ``seconds`` (a spare still
    importing answers once it reaches init(); a stopped one on this machine is killed by the
    sentinel meanwhile, and one that says nothing is killed here). Cut short when the
    survivors' world ``comm`` is revoked (a peer lost: the gather that follows fails)."""
    waiting, answered = [spare for spare in spares if _tell(spare, _CALL)], []
    deadline = time.monotonic() + seconds
    while waiting and time.monotonic() < deadline:
        if comm.Is_revoked():
            return answered  # (the waiting ones are left alone, called again later)
        for spare in list(waiting):
            taken = _take(spare.inter, 0, _ANSWER)
            if taken is not False:  # (None: it died)
                waiting.remove(spare)
            if taken:
                answered.append(spare)
        time.sleep(_POLL if waiting else 0)
    for spare in waiting:
        stopped.kill(spare.process)
    return answered


def dismiss() -> None:
    """At shutdown: tell the spares this rank spawned to leave (any one spawner's word is
    enough), and let go of them. One that does not say bye within 2 s (stopped, or hung) is
    killed where it runs on this machine: the ranks' MPI_Finalize would wait for it."""
    mine = [spare for spare in _pool if spare.inter is not None and _tell(spare, _DISMISS)]
    deadline = time.monotonic() + 2
    for spare in mine:
        while _sent(spare.inter, _BYE) is False and time.monotonic() < deadline:
            time.sleep(_POLL)
        if _sent(spare.inter, _BYE) is False:
            stopped.kill(spare.process)
    _drop({spare.port for spare in _pool})


def _post(comm: MPI.Comm, dest: int, tag: int) -> Optional[MPI.Request]:
    """Send an empty message without waiting for it; None where the peer is known dead.
    Open MPI's TCP transport connects to a peer at the first message and waits for its
    reply there, inside MPI_Send and MPI_Isend alike: a caller whose first word to a spare
    came while the spare was stopped waited for ever (a chaos run, three times). So every
    spawner says hello to its spare as it is spawned (``replenish``), and the connection is
    made then; whether a later message arrived shows in the answer that follows."""
    if not _alive(comm, dest):
        return None
    try:
        return comm.Isend(_EMPTY, dest=dest, tag=tag)
    except MPI.Exception:
        return None


def _tell(spare: Spare, tag: int) -> bool:
    """``_post`` to a spare, keeping the request until the spare leaves the pool (``_drop``);
    False if it is known dead."""
    request = _post(spare.inter, 0, tag)
    if request is not None:
        spare.pending.append(request)
    return request is not None


def _take(comm: MPI.Comm, rank: int, tag: int,
          status: Optional[MPI.Status] = None) -> Optional[bool]:
    """Receive the empty message ``tag`` (or any, ``MPI.ANY_TAG``: its tag in ``status``)
    from ``rank`` of ``comm`` if one has come: True; False if none has; None if ``rank`` is
    known dead. A message sent just before its sender died still matches a probe, but Open
    MPI refuses to receive it (MPI_ERR_PROC_FAILED): raised in a commit's look at the
    replacements, a spare killed after saying it was ready was taken for a lost member of the
    world, and every commit after the repair, which found nobody lost, met it again (a chaos
    run: 10 such repairs in a row)."""
    status = MPI.Status() if status is None else status
    try:
        if not comm.Iprobe(source=rank, tag=tag, status=status):
            return False
        comm.Recv([bytearray(1), MPI.BYTE], source=rank, tag=status.Get_tag())
        return True
    except MPI.Exception:
        return None


def _sent(inter: MPI.Intercomm, tag: int) -> Optional[bool]:
    """Whether the spare at the other end of ``inter`` has sent ``tag``; None if it died."""
    try:
        return inter.Iprobe(source=0, tag=tag)
    except MPI.Exception:
        return None


def _alive(comm: MPI.Comm, rank: int = 0) -> bool:
    """Whether ``rank`` of ``comm`` (a spare, or a spare's spawner) is not known dead."""
    try:
        comm.Iprobe(source=rank, tag=_NEVER)
        return True
    except MPI.Exception:
        return False


def _drop(ports: set) -> None:
    """Let go of the spares of ``ports``. Their communicator is freed once this rank's sends
    to them have completed, delivered or failed (2 s at most; else it is left to MPI): one
    freed with a send still pending to a spare killed meanwhile made MPI_Finalize crash on
    the news of its death (Open MPI 5.0.11, ompi_comm_revoke_local)."""
    leaving = [spare for spare in _pool if spare.port in ports]
    until = time.monotonic() + 2
    for spare in leaving:
        _pool.remove(spare)
        while spare.pending and not MPI.Request.Testall(spare.pending):
            if time.monotonic() > until:
                break
            time.sleep(_POLL)
        else:
            recovery.free(spare.inter)


def _connect(lobby: MPI.Intracomm, port: str, first: Optional[MPI.Comm],
             rest: list) -> tuple:
    """One round of ``call``: ``lobby`` connects to ``port`` and merges, then every member
    (the spare just taken in too) learns from rank 0 which ports are left. Returns the merged
    lobby and those ports; ``first`` (the survivors' world) is not freed."""
    inter = lobby.Connect(port, root=0)
    try:
        merged = inter.Merge(high=False)
    finally:
        inter.Disconnect()
    if lobby != first:
        recovery.free(lobby)
    return merged, merged.bcast(rest, root=0)


# --- the spare's side -------------------------------------------------------------------------
def run_as_spare(argv: list) -> None:
    """``python -m hvd_sgp.spare SCRIPT ARGS``: start MPI, open a port and tell the
    spawners, then run the script as ``python SCRIPT ARGS`` would (or ``-m MODULE ARGS``); its
    ``init()`` waits to be called up (``wait``)."""
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    port = MPI.Open_port()
    parent.bcast((port, MPI.Get_processor_name(), stopped.identity()), root=MPI.ROOT)
    _as_spare.update(parent=parent, port=port, launcher=os.getppid(),
                     spawners=parent.bcast(None, root=0))
    for rank in range(parent.Get_remote_size()):
        parent.Recv([bytearray(1), MPI.BYTE], source=rank, tag=_HELLO)
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def waiting() -> bool:
    """Whether this process is a spare not yet called up."""
    return bool(_as_spare)


def while_waiting(warm_up: Callable[[], None]) -> None:
    """An adapter's work a spare does before it waits (imports its first step would pay)."""
    _warm_ups.append(warm_up)


def wait(join_seconds: float) -> MPI.Intracomm:
    """A spare's init(): wait until a spawner calls it up, then accept the survivors'
    connection (and any later spares' with them); returns the merged world to join
    (world_grow.arrive). Dismissed, or with every spawner gone, the process exits. The
    accept and join have ``join_seconds`` (an alarm, as a spawned replacement's join guard)."""
    parent, port, launcher, processes = (_as_spare.pop(key) for key in
                                         ("parent", "port", "launcher", "spawners"))
    for warm_up in _warm_ups:
        warm_up()
    spawners = set(range(parent.Get_remote_size()))
    for rank in spawners:
        _say(parent, rank, _READY)
    while True:
        source, tag = _next_message(parent, spawners, (launcher, processes), port)
        if tag == _DISMISS:
            _say_bye(parent, source, spawners, port)
        if tag == _CALL and not _say(parent, source, _ANSWER):
            spawners.discard(source)  # (the caller died: the survivors repair and call again)
        elif tag == _GO:
            break
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(join_seconds)))
    parent.Free()
    inter = MPI.COMM_SELF.Accept(port)
    try:
        lobby = inter.Merge(high=True)
    finally:
        inter.Disconnect()
    MPI.Close_port(port)
    rest = lobby.bcast(None, root=0)
    while rest:
        lobby, rest = _connect(lobby, rest[0], None, rest[1:])
    return lobby


def _next_message(parent: MPI.Intercomm, spawners: set, job: tuple, port: str) -> tuple:
    """A waiting spare's next message from a live spawner: (source, tag). The job has ended
    when no spawner is left, when the launcher (``job``'s first: the parent process) is
    gone, or when every spawner (``job``'s second: their processes) ran on this machine and
    none runs now: ranks that ended in an abort were not all reported dead to a spare, which
    then kept mpirun waiting (a chaos run)."""
    launcher, processes = job
    looked = 0.0
    while True:
        message = _receive(parent, spawners, MPI.ANY_TAG)
        if message is not None:
            return message
        if time.monotonic() - looked > 1:
            looked = time.monotonic()
            if (not spawners or os.getppid() != launcher
                    or all(stopped.alive_here(p) is False for p in processes)):
                _leave(parent, port, "its job has ended")
        time.sleep(_POLL)


def _receive(parent: MPI.Intercomm, spawners: set, tag: int) -> Optional[tuple]:
    """One look at every live spawner for a message of ``tag``: the first found, received,
    as (source, tag), or None. A spawner found dead leaves ``spawners``."""
    status = MPI.Status()
    for rank in sorted(spawners):
        taken = _take(parent, rank, tag, status)
        if taken:
            return rank, status.Get_tag()
        if taken is None:
            spawners.discard(rank)
    return None


def _say(parent: MPI.Intercomm, rank: int, tag: int) -> bool:
    """A spare's word to spawner ``rank`` (False: it is known dead); its request is let go:
    the spawner takes it at once, or is gone."""
    request = _post(parent, rank, tag)
    if request is not None:
        request.Free()
    return request is not None


def _say_bye(parent: MPI.Intercomm, first: int, spawners: set, port: str) -> None:
    """Dismissed by ``first``: say bye to it, and for half a second to every other spawner
    whose dismissal comes (each waits for it, see ``dismiss``), then leave."""
    _say(parent, first, _BYE)
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        message = _receive(parent, spawners, _DISMISS)
        if message is not None:
            _say(parent, message[0], _BYE)
        else:
            time.sleep(_POLL)
    _leave(parent, port, None)


def _leave(parent: MPI.Intercomm, port: str, why: Optional[str]) -> None:
    if why is not None:
        print(f"hvd_sgp: a spare leaves: {why}", file=sys.stderr, flush=True)
    parent.Free()
    MPI.Close_port(port)
    raise SystemExit(0)
