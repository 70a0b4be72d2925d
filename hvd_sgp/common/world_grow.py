"""The world grows: spawned processes join it (``grow`` on the survivors, ``arrive`` on the
newcomers), after a repair (HVD_SGP_MAX_NP: at the next commit, ``replace``, or in the repair)
or a change of the discovered hosts (``resize``, which may also send ranks away). Who goes
where is planned in ``planners``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from hvd_sgp.common import discovery, fault_record, options, planners, recovery, spares
from hvd_sgp.common.errors import SgpError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.world import World, WorldChange, entry, notify, regroup, track, untrack


def missing(world: World) -> int:
    """How many ranks the world lacks to be its target size again (HVD_SGP_MAX_NP, and with
    host discovery the discovered slots); 0 without one."""
    target = planners.target_size(options.from_environment("max_np"), world.discovered)
    return planners.missing(target, world.world.Get_size())


def spares_wanted() -> int:
    """How many warm spares the world keeps (spares.py): HVD_SGP_SPARES where lost ranks are
    replaced (fault-tolerant mode with HVD_SGP_MAX_NP or host discovery), else none."""
    if not options.from_environment("fault_tolerant") or (
            options.from_environment("max_np") is None
            and not options.from_environment("host_discovery_script")):
        return 0
    return options.from_environment("spares")


def replacement_plan(world: World, seats: dict) -> dict:
    """Where the ranks ``missing`` go after a loss (``planners.replacements``)."""
    return planners.replacements(world.origins, seats, world.next_origin, missing(world),
                                 options.from_environment("local_size"))


def defer(world: World, seats: dict) -> None:
    """After a repair (HVD_SGP_REPLACE_AT ready or commit): remember where the lost ranks sat,
    for ``replace`` at a later commit, and start their replacements now, as warm spares on the
    lost ranks' hosts (collective; MPI_Init comes first in a spare, so the spawn costs the
    survivors about 0.1 s): they import while the survivors train on, and the take-in calls
    them up. The pool of HVD_SGP_SPARES, where it holds enough, is used as it is. ``seats``:
    the world before this loss (``planners.unreplaced`` keeps an earlier loss's)."""
    if world.vacated is None:
        world.vacated_at = time.monotonic()
    world.vacated = planners.unreplaced(seats, world.vacated)
    hosts = _vacated_hosts(world)
    spares.replenish(world.world, max(spares_wanted(), len(hosts)), world.processes, hosts)


def replacements_due(world: World) -> bool:
    """Whether replacements wait to be taken in (the same on every rank: the repair that
    deferred them was agreed)."""
    return world.vacated is not None and missing(world) > 0


def replacements_ready(world: World) -> bool:
    """At a commit while ``replacements_due``: whether to take them in now. Under
    HVD_SGP_REPLACE_AT=commit, yes (the survivors wait there for them to start). Under ready,
    once their spares say they are ready, so the survivors train on while the replacements
    start; or once that cannot come (a spare lost, none left) or has taken longer than a
    call's answer may (``answer_seconds``) on some rank. Collective then, with the same
    outcome on every rank."""
    if options.from_environment("replace_at") == "commit":
        return True
    overdue = time.monotonic() - world.vacated_at > answer_seconds()
    with recovery.translated("a commit's look at the replacements"):
        return spares.ready(world.world, _vacated_hosts(world), overdue)


def _vacated_hosts(world: World) -> list:
    """The hosts the deferred replacements go to, in the plan's order (None: anywhere)."""
    return [host for *_, host in replacement_plan(world, world.vacated)["newcomers"]]


def answer_seconds() -> float:
    """How long a spare called up may take to answer (one still importing answers once it
    is ready; a stopped one is killed by the sentinel within the detector's timeout)."""
    return float(options.from_environment("detector_timeout")) + 2


def replace(world: World) -> Optional[WorldChange]:
    """Take in the replacements a repair deferred (``defer``); every rank calls it, between two
    calls of the training function (hvd.elastic.run, after the commit's HostsUpdatedInterrupt),
    and the newcomers join at the ``state.sync()`` that follows. The survivors' optimizers fold
    first, so the world's de-biased average is kept. As in the repair: warm spares
    where there are, else spawned processes, in the lost ranks' seats; an MPI that cannot spawn
    leaves the world as it is, and no later commit tries again. A lost rank meanwhile raises
    PeerLostError; the repair that follows keeps the vacated seats for the next commit."""
    began = time.monotonic()
    seats = dict(world.vacated)
    size = world.world.Get_size()
    with recovery.repairing(began + recovery.repair_deadline()):
        with recovery.translated("the take-in of replacements"):
            # the optimizers fold into their exact average first (as resize does), so that
            # the sync's rank-0 model is the survivors' de-biased average, and their weights 1
            notify(WorldChange(world.world, world.local, world.cross, (), size, False))
            grown = grow(world, replacement_plan(world, seats), set(world.origins), seats)
    world.vacated = None
    if grown is None:
        return None
    fault_record.write("joined " + ",".join(map(str, grown.joined)), world.origin)
    if world.world.Get_rank() == 0:
        print(f"hvd_sgp: {joined_words(world, grown)} at a commit, after a take-in of "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
    return grown


def joined_words(world: World, grown: WorldChange) -> str:
    """Rank 0's words for the newcomers of ``grown`` (a repair's or a take-in's log line)."""
    ranks = sorted(world.origins.index(origin) for origin in grown.joined)
    spared = f", {grown.spares} from warm spares" if grown.spares else ""
    return (f"{len(grown.joined)} replacement(s) joined (rank(s) {ranks}{spared}): back to "
            f"{world.world.Get_size()} ranks")


def _spawn_infos(world: World, hosts: list) -> list:
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
            if (world.discovered is not None and host not in world.allocated
                    and host not in adding):
                adding.add(host)
                info.Set("PMIX_ADD_HOST", f"{host}:{dict(world.discovered).get(host, 1)}")
        infos.append(info)
    return infos


def grow(world: World, plan: dict, known: set, seats: dict) -> Optional[WorldChange]:
    """Take in the newcomers of ``plan``: warm spares where enough live ones are on their hosts
    (spares.call), else processes spawned now (``_spawn``), merged with the survivors. The
    newcomer's side is ``arrive``: both end in ``_settle``, which spawns the spares the pool
    then lacks. The subscribers are called with ``joined`` set
    and must not communicate for it (the newcomers have none yet): an optimizer puts its
    engine aside, to start again with the newcomers' own engines at the same point of the
    training function (see engine.retire). An MPI that cannot spawn (no slot, no such host)
    leaves the world as it was, with a warning. ``known`` gains the newcomers' origins and
    ``seats`` their seats (for a later attempt's plan)."""
    hosts = [host for _, _, _, host in plan["newcomers"]]
    chosen = spares.usable(world.world, hosts)
    merged = None
    if chosen:
        with recovery.spawning():
            merged = spares.call(world.world, chosen, answer_seconds())
        chosen = chosen if merged is not None else []
    if merged is None:
        merged = _spawn(world, hosts)
        if merged is None:
            return None
    size_before = world.world.Get_size()
    world.allocated |= {host for _, _, _, host in plan["newcomers"] if host is not None}
    merged.bcast(dict(plan, hosts=(world.discovered, world.allocated), spares=spares.held()),
                 root=0)
    comm, local, cross, entries = _settle(merged, plan, world.origin, world.node, world.host)
    world.install(comm, local, cross, entries)
    joined = tuple(origin for origin, _, _, _ in plan["newcomers"])
    known.update(joined)
    seats.update({e.origin: (plan["slots"][e.origin], e.node, e.host) for e in entries})
    change = WorldChange(comm, local, cross, (), size_before, False, joined, len(chosen))
    notify(change)
    return change


def _spawn(world: World, hosts: list) -> Optional[MPI.Intracomm]:
    """Spawn one process per host of ``hosts`` (MPI_Comm_spawn_multiple from the survivors,
    the same program and arguments) and merge with them; None where MPI cannot spawn."""
    count = len(hosts)
    infos = _spawn_infos(world, hosts)
    with recovery.spawning():
        try:
            inter = world.world.Spawn_multiple([sys.executable] * count,
                                               [spares.script_argv()] * count, [1] * count,
                                               infos, root=0)
        except MPI.Exception as error:
            if recovery.is_failure(error):
                raise
            if world.world.Get_rank() == 0:
                print(f"hvd_sgp: could not start {count} new process(es) "
                      f"({error.Get_error_string()}); {world.world.Get_size()} ranks go on",
                      file=sys.stderr, flush=True)
            return None
        finally:
            for info in infos:
                info.Free()
        track(inter)
        try:
            return inter.Merge(high=False)
        finally:
            untrack(inter)
            inter.Disconnect()  # (with the newcomers' parent.Disconnect(): see arrive)


def _settle(merged: MPI.Comm, plan: dict, origin: int, node: Any,
            host: str) -> tuple[MPI.Comm, MPI.Comm, MPI.Comm, list]:
    """Survivors and newcomers alike: order the merged world by seat, and form its nodes."""
    track(merged)
    try:
        comm = merged.Split(0, key=plan["slots"][origin])
    finally:
        untrack(merged)
        recovery.free(merged)
    entries = comm.allgather(entry(origin, node, host))
    local, cross = regroup(comm, [e.node for e in entries])
    spares.replenish(comm, spares_wanted(), [e.process for e in entries])
    return comm, local, cross, entries


def arrive(parent: Optional[MPI.Comm], join_seconds: float) -> World:
    """A newcomer's init(): merge with the survivors that spawned it (``parent``) or, in a
    spare (``parent`` None), with those that called it up (spares.wait); take the seat their
    plan gives (``grow``), and form the nodes with them. A failure on the way (a survivor
    lost meanwhile) ends this process, and the survivors repair without it; so does a join
    that has not completed within ``join_seconds``, the repair's deadline (runtime's join
    guard; a spare's is armed once it is called up)."""
    try:
        if parent is None:
            merged = spares.wait(join_seconds)
        else:
            parent.Set_errhandler(MPI.ERRORS_RETURN)
            merged = parent.Merge(high=True)
            # Disconnected, not kept: a parent intercommunicator still held at exit makes
            # MPI_Finalize wait forever to disconnect from survivors that no longer hold theirs
            # (the exit alarm then killed the replacement, and PRRTE 3.0 reported the spawned
            # job's abnormal end as "LAUNCHER JOB OBJECT NOT FOUND", its parent job being gone).
            parent.Disconnect()
        plan = merged.bcast(None, root=0)
        spares.adopt(plan["spares"])
        origin, _, node, host = plan["newcomers"][merged.Get_rank() - plan["survivors"]]
        node = MPI.Get_processor_name() if node is None else node
        host = MPI.Get_processor_name() if host is None else host
        comm, local, cross, entries = _settle(merged, plan, origin, node, host)
    except MPI.Exception as error:
        recovery.exclude_self(f"this replacement could not join the job "
                              f"({error.Get_error_string()})")
    world = World(comm, local, cross, MPI.Query_thread(), node, origin, entries, host)
    world.discovered, world.allocated = plan["hosts"]
    world.next_origin = plan["next_origin"]
    world.replacement = True
    recovery.arrived()
    return world


# --- host discovery: the world follows the discovered hosts ---------------------------------
def _resize_plan(world: World, hosts: list) -> dict:
    return planners.resize(world.origins, world.hosts, hosts, world.next_origin,
                           options.from_environment("max_np"),
                           options.from_environment("local_size"))


def hosts_changed(world: World, latest: Optional[list]) -> int:
    """Compare the hosts the discovery script printed last (rank 0's, the same on every rank:
    hvd.elastic's commit broadcasts them) with those the world is laid out for. A change that
    moves no rank (slots beyond HVD_SGP_MAX_NP, a host without ranks gone) is taken silently;
    any other waits as ``pending`` for ``resize``. Returns discovery.ADDED when ranks will
    join and REMOVED when ranks will leave (Horovod's HostUpdateResult, which flags hosts; here
    the ranks that move decide, so that ``skip_sync`` never skips a newcomer's sync), 0 for no
    change."""
    if latest is None or world.discovered is None:
        return 0
    latest = discovery.merged_order(world.discovered, latest)
    if latest == world.discovered:
        return 0
    change = planners.host_change(_resize_plan(world, latest))
    if change:
        world.pending = latest
    else:
        world.discovered = latest
    return change


def resize(world: World) -> bool:
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
       HVD_SGP_MAX_NP, and seated after the ranks that stay (``grow``); they join at
       hvd.elastic's ``state.sync()``, as replacements do.
    Fewer ranks than HVD_SGP_MIN_NP end the job with an SgpError on every rank. A lost rank
    during the change raises PeerLostError; after the repair, ``resize`` is called again and
    works out what is left to do from the world as it then is.
    """
    began = time.monotonic()
    plan = _resize_plan(world, world.pending)
    keep = len(plan["slots"]) - len(plan["newcomers"])
    minimum = options.from_environment("min_np")
    if keep + len(plan["newcomers"]) < minimum:
        raise SgpError(f"the discovered hosts ({discovery.describe(world.pending)}) give "
                       f"{keep + len(plan['newcomers'])} ranks, fewer than "
                       f"HVD_SGP_MIN_NP={minimum}: the job ends")
    leaving = world.origin in plan["leaving"]
    grown = None
    with recovery.repairing(began + recovery.repair_deadline()):
        with recovery.translated("the change of hosts"):
            comm = world.world.Split(MPI.UNDEFINED if leaving else 0, key=world.world.Get_rank())
            if leaving:
                return True
            size_before = world.world.Get_size()
            entries = comm.allgather(world.entry())
            local, cross = regroup(comm, [e.node for e in entries])
            world.install(comm, local, cross, entries)
            notify(WorldChange(comm, local, cross, tuple(plan["leaving"]), size_before, False))
            world.discovered = world.pending
            world.vacated = None  # (the plan seats newcomers for the discovered hosts)
            if plan["newcomers"]:
                grown = grow(world, plan, set(world.origins), world.seats())
            world.pending = None
    if grown is not None:
        fault_record.write("joined " + ",".join(map(str, grown.joined)), world.origin)
    if world.world.Get_rank() == 0:
        left = f"rank(s) {plan['leaving']} left" if plan["leaving"] else "no rank left"
        where = sorted({host for *_, host in plan["newcomers"]})
        added = (f"{len(grown.joined)} rank(s) joined on {where}" if grown is not None
                 else "no rank joined")
        print(f"hvd_sgp: hosts changed to {discovery.encode(world.discovered)}: {left}, "
              f"{added}; {world.world.Get_size()} ranks go on after "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
    return False
