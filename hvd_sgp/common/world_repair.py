"""The world's repair after a lost rank (fault-tolerant mode, ULFM): shrink to the survivors,
re-form the nodes, tell the subscribers, and with HVD_SGP_MAX_NP grow back (world_grow).
The pieces that notice a failure and bound the repair in time are in ``recovery``.
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from hvd_sgp.common import fault_record, options, recovery, world_grow
from hvd_sgp.common.errors import PeerLostError, PeerTimeoutError, SgpError
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.world import World, WorldChange, notify, regroup, revoke

_said = [False]  # the plain-script note on HVD_SGP_MAX_NP, printed once


def repair(world: World, realign: bool) -> WorldChange:
    """Repair ``world`` in place after a lost rank; every survivor calls it (runtime.repair).

    1. Revoke every hvd_sgp communicator (late ranks learn at their next MPI call), and let
       this rank's worker threads end on it (recovery.worker_thread).
    2. Shrink the world to its survivors (ULFM's agreement inside MPI_Comm_shrink gives every
       survivor the same communicator); the lost ranks are the difference.
    3. Re-form the nodes and the cross-node communicators (``regroup``).
    4. Call the ``on_world_change`` subscribers (optimizers rebuild their graph and fold their
       PushSum state). An agreement (MPI_Comm_agree) closes 3 and 4 alike on every
       survivor: all go on, all start over, or all raise (``_rebuild``). The agreement also
       ends the job on every survivor after repairs in a row that found nobody lost
       (recovery.repaired).
    5. With HVD_SGP_MAX_NP (or host discovery), outside a step (``realign`` False:
       hvd.elastic.run's repair), replacements: by default they start now and the survivors
       go on; they join at a later commit (``world_grow.defer``, then ``replace``), as
       Horovod takes in new hosts; with HVD_SGP_REPLACE_AT=repair they are taken in here
       (``world_grow.grow``). Not while a change of hosts waits, whose ``resize`` places the
       newcomers. A failure during 2-5 starts over at 1.
    Fewer survivors than HVD_SGP_MIN_NP end the job with an SgpError on every survivor.
    """
    began = time.monotonic()
    deadline = began + recovery.repair_deadline()
    seats = world.seats()  # the world as it was: names the lost, places their replacements
    known = set(world.origins)
    attempts = 0  # spawns tried: an MPI that keeps failing them leaves the world smaller
    grown = None
    comm = world.world  # what the next attempt shrinks: a communicator every survivor holds
    with recovery.repairing(deadline):
        while True:
            world.revoke_all()
            recovery.end_workers(deadline)  # (join()'s served step ends at the revoke)
            try:
                with recovery.translated("the repair of the world"), \
                        recovery.blocked_in("MPI_Comm_shrink"):
                    survivors = comm.Shrink()  # (Ishrink fails on a revoked world in 5.0)
                if comm != world.world:  # an earlier attempt's, never installed here
                    recovery.free(comm)
                comm = survivors
                change, in_vain = _rebuild(world, survivors, known, realign)
                size = change.world.Get_size()  # (a grow frees change.world)
                if not realign and world.pending is None and world_grow.missing(world) > 0:
                    if options.from_environment("replace_at") != "repair":
                        world_grow.defer(world, seats)
                    elif attempts < 3:
                        attempts += 1
                        comm = world.world  # a failed grow starts over from what it left
                        with recovery.translated("the repair of the world"):
                            grown = world_grow.grow(
                                world, world_grow.replacement_plan(world, seats), known, seats)
                break
            except PeerLostError as error:
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"the world could not be repaired within "
                                           f"{recovery.repair_deadline():.0f} s") from None
                if world.world.Get_rank() == 0:
                    print(f"hvd_sgp: the repair starts over: {error}", file=sys.stderr,
                          flush=True)
    lost = sorted(known - set(world.origins))
    fault_record.write("lost " + ",".join(map(str, lost)), world.origin)
    if grown is not None:
        fault_record.write("joined " + ",".join(map(str, grown.joined)), world.origin)
    if world.world.Get_rank() == 0:
        joined = f"; {world_grow.joined_words(world, grown)}" if grown is not None else ""
        if world.vacated is not None:
            joined = f"; {world_grow.missing(world)} replacement(s) to join at a commit"
        print(f"hvd_sgp: lost rank(s) {lost}; {size} of "
              f"{change.size_before} ranks go on{joined} after a repair of "
              f"{time.monotonic() - began:.2f} s", file=sys.stderr, flush=True)
        if realign and world_grow.missing(world) > 0 and not _said[0]:
            _said[0] = True
            print("hvd_sgp: HVD_SGP_MAX_NP replaces lost ranks only under hvd.elastic.run "
                  "(a replacement joins at its state.sync()); this script repairs inside "
                  "the optimizer's step, so it goes on with fewer ranks",
                  file=sys.stderr, flush=True)
    if in_vain:
        raise recovery.in_vain_error()
    return grown or change


def _rebuild(world: World, survivors: MPI.Comm, known: set,
             realign: bool) -> tuple[WorldChange, bool]:
    """Steps 3 and 4 of ``repair`` on the shrunk world, closed by an agreement (ULFM's
    MPI_Comm_agree, whose outcome is the same on every survivor): either every survivor
    finished them, or every one starts over, or every one raises. Without it a rank dying
    inside step 4 may leave one survivor with an undefined buffer (a collective cut short:
    a pickled allgather that fails to load, seen 1 run in 8 with 8 ranks) while the others
    go on with a world it never joined. Returns the change and whether the repairs are in
    vain (``recovery.repaired`` on some survivor: its bit of the agreement ends the job on
    every one)."""
    failure: Optional[Exception] = None
    try:
        with recovery.translated("the repair of the world"):
            change = _regroup(world, survivors, known, realign)
            notify(change)
    except Exception as error:  # the others may wait on this rank in a collective: revoke
        failure = error
        world.revoke_all()
        revoke(survivors)
    foreign = failure is not None and not isinstance(failure, PeerLostError)
    in_vain = failure is None and recovery.repaired(bool(change.lost))
    waited = float(options.from_environment("detector_timeout"))  # (for a rank stuck before)
    with recovery.translated("the agreement that ends the repair"), recovery.blocked_in(
            "MPI_Comm_agree", extra=waited):  # a death: start over
        agreed = survivors.Agree(int(failure is None) | 2 * int(not foreign)
                                 | 4 * int(not in_vain))
    if agreed & 1:
        return change, not agreed & 4
    if foreign:
        raise failure
    if not agreed & 2:
        raise SgpError("the repair of the world failed on another rank (its error is "
                       "printed there)")
    raise failure or recovery.lost("another survivor lost a peer during the repair")


def _regroup(world: World, survivors: MPI.Comm, known: set, realign: bool) -> WorldChange:
    """Step 3 of ``repair``: the survivors' world, its nodes and its membership."""
    size_before = world.world.Get_size()
    entries = survivors.allgather(world.entry())
    known.update(world.origins)  # replacements taken in by an attempt that failed later
    lost = tuple(sorted(known - {e.origin for e in entries}))
    minimum = options.from_environment("min_np")
    if survivors.Get_size() < minimum:
        raise SgpError(f"only {survivors.Get_size()} ranks survive (lost {list(lost)}), fewer "
                       f"than HVD_SGP_MIN_NP={minimum}: the job ends")
    if world.discovered is not None:  # a failure may have cut a change of hosts short
        world.discovered, world.pending, world.allocated = survivors.bcast(
            (world.discovered, world.pending, world.allocated), root=0)
    local, cross = regroup(survivors, [e.node for e in entries])
    world.install(survivors, local, cross, entries)
    return WorldChange(survivors, local, cross, lost, size_before, realign)
