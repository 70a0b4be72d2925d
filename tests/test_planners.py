"""The planners of the world's changes (hvd_sgp.common.planners), in one process without MPI:
who goes where after a loss, a grow or a change of hosts. Every rank works the same plan out
on its own, so each plan must be a function of the membership alone and keep the promises
the repair and the resize rely on (distinct seats, rank 0 a survivor's, lost seats refilled
lowest first, slots per host respected)."""
import math
import sys

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hvd_sgp.common import discovery, planners

HOSTS = "abcde"
# Wall-clock limits measure the machine, not the planners: a loaded CI host stalls a draw.
UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_planners_load_no_mpi():
    """The planners import without an MPI library (the launcher and tests use them)."""
    import subprocess

    code = ("import sys; import hvd_sgp.common.planners; "
            "assert 'mpi4py' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- nodes after ranks left or joined ---------------------------------------------------------
@UNTIMED
@given(st.lists(st.sampled_from(HOSTS), min_size=1, max_size=24))
def test_node_colors_cut_every_node_into_equal_groups(nodes):
    colors = planners.node_colors(nodes)
    sizes = [nodes.count(node) for node in set(nodes)]
    group = math.gcd(*sizes)  # the largest size that divides every node
    members: dict = {}
    for rank, color in enumerate(colors):
        members.setdefault(color, []).append(rank)
    for ranks in members.values():
        assert len(ranks) == group  # the same number of ranks on every node
        assert len({nodes[r] for r in ranks}) == 1  # a group never spans two nodes
        of_node = [r for r, node in enumerate(nodes) if node == nodes[ranks[0]]]
        start = of_node.index(ranks[0])
        assert ranks == of_node[start:start + group]  # consecutive ranks of its node
    if len(set(sizes)) == 1:  # nodes of one size stay whole
        assert len(members) == len(set(nodes))


def test_node_colors_of_a_node_that_lost_one_of_two_ranks():
    assert len(set(planners.node_colors(["a", "a", "b"]))) == 3
    assert planners.node_colors([0, 0, 1, 1]) == [0, 0, 2, 2]


# --- replacements after a loss -----------------------------------------------------------------
@st.composite
def losses(draw):
    """A world of n ranks (origins in any order of a past grow), the ranks it lost, how many
    replacements are wanted and HVD_SGP_LOCAL_SIZE."""
    n = draw(st.integers(1, 12))
    local_size = draw(st.sampled_from([None] + [d for d in range(1, n + 1) if n % d == 0]))
    origins = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n, unique=True))
    lost = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    count = draw(st.integers(0, len(lost) + 3))
    seats = {origin: (rank, rank // local_size if local_size else HOSTS[rank % 3],
                      HOSTS[rank % 3]) for rank, origin in enumerate(origins)}
    survivors = [origin for rank, origin in enumerate(origins) if rank not in lost]
    return n, local_size, seats, survivors, sorted(lost), count, max(origins) + 1


@UNTIMED
@given(losses())
def test_replacements_refill_the_lost_seats_lowest_first(case):
    n, local_size, seats, survivors, lost, count, next_origin = case
    plan = planners.replacements(survivors, seats, next_origin, count, local_size)
    slots, newcomers = plan["slots"], plan["newcomers"]
    assert plan["survivors"] == len(survivors)
    assert [origin for origin, *_ in newcomers] == list(range(next_origin, next_origin + count))
    assert plan["next_origin"] == next_origin + count
    assert len(set(slots.values())) == len(slots) == len(survivors) + count  # distinct seats
    assert min(slots, key=slots.get) in survivors  # rank 0 is a survivor's (state.sync())
    moved = [o for o in survivors if slots[o] != seats[o][0]]
    if 0 in lost:  # the lowest survivor moved to rank 0; nobody else moved
        assert moved == [survivors[0]] and slots[survivors[0]] == 0
        vacated = sorted([seats[survivors[0]][0]] + lost[1:])
    else:
        assert moved == []
        vacated = lost
    wanted = (vacated + list(range(n, n + count)))[:count]
    assert sorted(slot for _, slot, _, _ in newcomers) == wanted
    if count == len(lost):  # the world has its old shape again
        assert sorted(slots.values()) == list(range(n))
    by_rank = {seat[0]: seat for seat in seats.values()}
    for _, slot, node, host in newcomers:
        if slot >= n:  # a new seat at the end: its own host; its node by HVD_SGP_LOCAL_SIZE
            assert host is None and node == (None if local_size is None else slot // local_size)
            continue
        seat = by_rank[0] if slot == seats[survivors[0]][0] and 0 in lost else by_rank[slot]
        assert host == seat[2]  # in the lost rank's place (rank 0's, for the moved survivor)
        assert node == (None if local_size is None else seat[1])


@UNTIMED
@given(losses())
def test_replacements_after_a_grow_fill_nothing_twice(case):
    """A second loss after replacements joined: the plan of the grown world again gives every
    process its own seat, the new origins continue the old."""
    n, local_size, seats, survivors, lost, count, next_origin = case
    assume(n >= 2)
    first = planners.replacements(survivors, seats, next_origin, len(lost), local_size)
    order = sorted(first["slots"], key=first["slots"].get)
    nodes = [0] * len(order)
    grown = planners.seats(order, nodes, [None] * len(order))
    again = planners.replacements(order[1:], grown, first["next_origin"], 1, local_size)
    assert sorted(again["slots"].values()) == list(range(len(order)))
    assert again["newcomers"][0][0] == first["next_origin"]


@UNTIMED
@given(losses(), st.data())
def test_replacements_deferred_over_two_losses_restore_the_world_before_the_first(case, data):
    """HVD_SGP_REPLACE_AT=ready or commit: a second loss comes before the first's replacements
    join. The survivors' seats are then the shrunk world's (ranks 0..k-1); planned against
    ``unreplaced`` of those and the first loss's seats, the take-in gives the world its shape
    before the first loss: every survivor back in its old rank (but the one moved to rank 0),
    every lost seat refilled."""
    n, local_size, seats, survivors, lost, _, next_origin = case
    assume(len(survivors) >= 2)
    order = sorted(survivors, key=lambda origin: seats[origin][0])
    shrunk = planners.seats(order, [seats[o][1] for o in order], [seats[o][2] for o in order])
    second = data.draw(st.sets(st.sampled_from(order[1:]), max_size=len(order) - 2))
    left = [origin for origin in order if origin not in second]
    merged = planners.unreplaced(shrunk, planners.unreplaced(seats, None))
    plan = planners.replacements(left, merged, next_origin, n - len(left), local_size)
    slots = plan["slots"]
    assert sorted(slots.values()) == list(range(n))
    assert min(slots, key=slots.get) == left[0]  # rank 0 a survivor's
    moved = [origin for origin in left if slots[origin] != seats[origin][0]]
    assert moved == ([] if seats[left[0]][0] == 0 else [left[0]])
    wanted = {seats[origin][0] for origin in seats if origin not in left}
    if moved:
        wanted = (wanted - {0}) | {seats[left[0]][0]}
    assert {slot for _, slot, _, _ in plan["newcomers"]} == wanted


def test_replacement_takes_the_seat_of_a_lost_rank_zero():
    seats = planners.seats([0, 1, 2, 3], [0, 0, 1, 1], ["a", "a", "b", "b"])
    plan = planners.replacements([1, 2, 3], seats, 4, 1, 2)
    assert plan["slots"] == {1: 0, 2: 2, 3: 3, 4: 1}
    assert plan["newcomers"] == [(4, 1, 0, "a")]  # rank 1's seat, on rank 0's node and host


def test_target_size_and_missing():
    hosts = [("a", 2), ("b", 3)]
    assert planners.target_size(None, None) is None
    assert planners.target_size(4, None) == 4
    assert planners.target_size(None, hosts) == 5  # every discovered slot
    assert planners.target_size(8, hosts) == 5
    assert planners.missing(None, 3) == 0
    assert planners.missing(5, 3) == 2 and planners.missing(2, 3) == 0


# --- a change of the discovered hosts --------------------------------------------------------
@st.composite
def host_changes(draw):
    n = draw(st.integers(1, 12))
    hosts_of_ranks = draw(st.lists(st.sampled_from(HOSTS), min_size=n, max_size=n))
    names = draw(st.lists(st.sampled_from(HOSTS), min_size=1, max_size=5, unique=True))
    hosts = [(name, draw(st.integers(1, 4))) for name in names]
    origins = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n, unique=True))
    max_np = draw(st.none() | st.integers(1, 20))
    local_size = draw(st.sampled_from([None, 1, 2]))
    return origins, hosts_of_ranks, hosts, max(origins) + 1, max_np, local_size


@UNTIMED
@given(host_changes())
def test_resize_keeps_the_lowest_ranks_of_a_host_and_fills_free_slots(case):
    origins, hosts_of_ranks, hosts, next_origin, max_np, local_size = case
    plan = planners.resize(*case)
    room = dict(hosts)
    leaving, newcomers, slots = plan["leaving"], plan["newcomers"], plan["slots"]
    stay = [origin for origin in origins if origin not in leaving]
    assert plan["survivors"] == len(stay)
    assert sorted(stay + leaving) == sorted(origins) and not set(stay) & set(leaving)
    for name in set(hosts_of_ranks):  # a host keeps its lowest ranks, up to its slots
        ranks = [o for o, h in zip(origins, hosts_of_ranks) if h == name]
        assert [o for o in ranks if o in stay] == ranks[:room.get(name, 0)]
    assert [slots[o] for o in stay] == list(range(len(stay)))  # rank order kept, first
    free = [name for name, count in hosts
            for _ in range(count - sum(1 for o, h in zip(origins, hosts_of_ranks)
                                       if h == name and o in stay))]
    wanted = len(free) if max_np is None else max(0, min(len(free), max_np - len(stay)))
    assert [host for *_, host in newcomers] == free[:wanted]  # host order, up to max_np
    assert [slot for _, slot, _, _ in newcomers] == list(range(len(stay), len(stay) + wanted))
    assert [origin for origin, *_ in newcomers] == list(range(next_origin,
                                                              next_origin + wanted))
    assert all(node == (None if local_size is None else slot // local_size)
               for _, slot, node, _ in newcomers)
    change = planners.host_change(plan)
    assert bool(change & discovery.ADDED) == bool(newcomers)
    assert bool(change & discovery.REMOVED) == bool(leaving)


@UNTIMED
@given(host_changes())
def test_resize_to_the_same_hosts_moves_nobody(case):
    origins, hosts_of_ranks, _, next_origin, _, local_size = case
    same = [(name, hosts_of_ranks.count(name)) for name in dict.fromkeys(hosts_of_ranks)]
    plan = planners.resize(origins, hosts_of_ranks, same, next_origin, None, local_size)
    assert plan["leaving"] == [] and plan["newcomers"] == []
    assert planners.host_change(plan) == 0


def test_resize_plan_keeps_ranks_and_fills_free_slots():
    """Who leaves and who comes when the hosts change: a rank stays while its host has a slot
    for it (the highest ranks of a host leave first), the ranks that stay keep their order,
    newcomers fill free slots in host order up to HVD_SGP_MAX_NP and take the seats after
    them."""
    origins, hosts = [0, 1, 2, 3], ["a", "a", "b", "b"]
    plan = planners.resize(origins, hosts, [("a", 2), ("b", 1)], 4, 4, None)
    assert plan["leaving"] == [3] and plan["newcomers"] == []
    plan = planners.resize(origins, hosts, [("b", 3), ("c", 2)], 4, 4, None)
    assert plan["leaving"] == [0, 1]
    assert [(o, slot, host) for o, slot, _, host in plan["newcomers"]] == [(4, 2, "b"),
                                                                           (5, 3, "c")]
    assert plan["slots"] == {2: 0, 3: 1, 4: 2, 5: 3}
    plan = planners.resize(origins, hosts, [("a", 2), ("b", 2), ("c", 2)], 4, None, None)
    assert plan["leaving"] == [] and len(plan["newcomers"]) == 2  # no --max-np: every slot
