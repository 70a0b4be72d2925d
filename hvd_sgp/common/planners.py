"""Who goes where when the world changes: the decisions of a repair, a grow and a change of
hosts, as pure functions of the world's membership (no MPI here).

Every rank works a plan out alike from the same membership, so the plans need no agreement of
their own. Ranks are named by origin (the rank at init; a newcomer's is new): an origin names
one process for good, a rank only a seat in the current world. A plan is a dict:
``survivors`` (how many ranks come first), ``newcomers`` ((origin, slot, node, host) for each
process to spawn; node or host None: the newcomer's own), ``slots`` (origin -> rank in the
world that follows) and ``next_origin``; a resize plan also names the ``leaving`` origins.
"""
from __future__ import annotations

import math
from typing import Hashable, Optional, Sequence

from hvd_sgp.common import discovery


def node_colors(nodes: Sequence[Hashable]) -> list[int]:
    """The node of each rank (a split color) after ranks left or joined: each node keeps its
    ranks in rank order, cut into groups of the largest size that divides every node (SGP's
    shards need the same number of ranks on every node), so a node that lost one of two ranks
    makes every rank its own node. ``nodes``: each rank's node key, by rank."""
    members: dict = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    group = math.gcd(*(len(ranks) for ranks in members.values()))
    widest = max(len(ranks) for ranks in members.values())
    colors = [0] * len(nodes)
    for index, ranks in enumerate(sorted(members.values())):
        for position, rank in enumerate(ranks):
            colors[rank] = index * widest + position // group
    return colors


def target_size(max_np: Optional[int], discovered: Optional[list]) -> Optional[int]:
    """The world's size to grow back to: HVD_SGP_MAX_NP, and with host discovery at most the
    discovered slots (all of them without HVD_SGP_MAX_NP, as Horovod's); None: no growing."""
    if discovered is not None:
        slots = discovery.total(discovered)
        max_np = slots if max_np is None else min(max_np, slots)
    return max_np


def missing(target: Optional[int], size: int) -> int:
    """How many ranks a world of ``size`` lacks to be its target size (0 without one)."""
    return 0 if target is None else max(0, target - size)


def seats(origins: Sequence[int], nodes: Sequence[Hashable],
          hosts: Sequence[Optional[str]]) -> dict:
    """origin -> (rank, node, host) of every rank of a world, from its membership by rank."""
    return {origin: (slot, node, host)
            for slot, (origin, node, host) in enumerate(zip(origins, nodes, hosts))}


def unreplaced(seats: dict, earlier: Optional[dict]) -> dict:
    """The seats a deferred take-in plans its replacements against (world_grow.defer): the
    world's before this loss (``seats``), where an earlier loss not yet replaced left
    ``earlier``. Its seats win for the ranks it knew: the survivors keep the ranks they had
    before it (not those the shrink gave them), and its lost ranks' seats stay vacant; a rank
    taken in since (by a take-in a death cut short) keeps its own."""
    return {**seats, **(earlier or {})}


def replacements(origins: Sequence[int], seats: dict, next_origin: int, count: int,
                 local_size: Optional[int]) -> dict:
    """Where ``count`` replacements go after ranks were lost: each takes a lost rank's seat
    (its rank, so ``hvd.rank()`` is the lost rank's again, and its node), lowest first, then
    new seats at the end; each gets a new origin. Rank 0 stays a survivor's: hvd.elastic's
    ``state.sync()`` broadcasts rank 0's state, so when rank 0 was lost the lowest survivor
    moves there and its replacement takes that survivor's rank instead (on rank 0's node).
    ``origins``: the survivors'; ``seats``: the world as it was before the loss (``seats``);
    ``local_size``: HVD_SGP_LOCAL_SIZE (None: a node is a host)."""
    alive = set(origins)
    slots = {origin: seats[origin][0] for origin in origins}
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
    while len(vacant) < count:
        vacant.append((top, None, None))
        top += 1
    newcomers = []
    for index, (slot, node, host) in enumerate(vacant[:count]):
        if local_size is None:
            node = None  # a node is a host: the replacement's own, wherever it starts
        elif node is None:
            node = slot // local_size
        newcomers.append((next_origin + index, slot, node, host))
    slots.update({origin: slot for origin, slot, _, _ in newcomers})
    return {"survivors": len(origins), "newcomers": newcomers, "slots": slots,
            "next_origin": next_origin + len(newcomers)}


def resize(origins: Sequence[int], hosts_of_ranks: Sequence[Optional[str]], hosts: list,
           next_origin: int, max_np: Optional[int], local_size: Optional[int]) -> dict:
    """Who stays, who leaves and where newcomers go for the discovered ``hosts`` ((name,
    slots) pairs): a rank stays while its host has a slot for it (lowest ranks first); the
    free slots then take newcomers, host by host, until ``max_np``. Ranks that stay keep their
    order and come first (rank 0 stays a rank that holds the state ``state.sync()`` sends);
    newcomers follow. ``origins`` and ``hosts_of_ranks``: the world's, by rank."""
    room = dict(hosts)
    stay, leaving = [], []
    for origin, host in zip(origins, hosts_of_ranks):
        if room.get(host, 0) > 0:
            room[host] -= 1
            stay.append(origin)
        else:
            leaving.append(origin)
    free = sum(room.values()) if max_np is None else min(sum(room.values()), max_np - len(stay))
    places = [name for name, _ in hosts for _ in range(room[name])][:max(0, free)]
    newcomers = []
    for index, host in enumerate(places):
        slot = len(stay) + index
        node = None if local_size is None else slot // local_size
        newcomers.append((next_origin + index, slot, node, host))
    slots = {origin: slot for slot, origin in enumerate(stay)}
    slots.update({origin: slot for origin, slot, _, _ in newcomers})
    return {"survivors": len(stay), "newcomers": newcomers, "slots": slots,
            "leaving": leaving, "next_origin": next_origin + len(newcomers)}


def host_change(plan: dict) -> int:
    """discovery.ADDED when a resize ``plan`` brings ranks in, REMOVED when ranks leave (both
    or'ed; 0: no rank moves)."""
    return ((discovery.ADDED if plan["newcomers"] else 0)
            | (discovery.REMOVED if plan["leaving"] else 0))
