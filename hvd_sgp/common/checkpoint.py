"""The checkpoint contract of an SGP optimizer: which part of its state every rank shares and
which part belongs to one rank, and the agreement that finds ranks out of step.

Shared (equal on every rank whenever the ranks are in step): the iteration (the graph's
position and the schedule's stage), the epoch, the outer optimizer's state (SlowMo, DiLoCo:
taken on exactly averaged models; over gossip each node's own, and root's is then as good as
any). Horovod's recipe (rank 0 loads, then ``broadcast_optimizer_state``) gives
every rank root's shared part.

Per rank: the PushSum weights, compressed gossip's public copies (error feedback lives in
them) and random-k's run weights. They are exact only together with the same rank's
parameters and its peers' per-rank state, so they are restored only from the same rank's
checkpoint of the same world, and only when every rank restores its own; anywhere else every
rank starts them afresh (weight 1, copies opened anew by the next exact message), which is a
consistent SGP state for any parameters.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from hvd_sgp.common.errors import ConsistencyError
from hvd_sgp.common.mpi import MPI

SHARED = ("iteration", "epoch", "outer", "slowmo")  # (slowmo: the outer state's older name)


def shared(state: dict) -> dict:
    """The part of ``state`` that every rank takes from root under Horovod's recipe."""
    return {key: state[key] for key in SHARED if key in state}


def own(state: dict, rank: int, size: int) -> bool:
    """Whether ``state`` was saved by this rank of a world of this size with nothing in
    flight, so that its per-rank part can be restored exactly (a checkpoint of before these
    records counts as its own, as it always did)."""
    return (state.get("rank", rank) == rank and state.get("size", size) == size
            and bool(state.get("settled", True)))


def agree(comm: MPI.Comm, steps: int, restored: bool,
          wait: Callable[[MPI.Request, str], None]) -> bool:
    """One non-blocking allgather (``wait`` bounds it): every rank must be at the same
    iteration, else ConsistencyError on every rank naming each rank's iteration. Returns
    whether per-rank state must start afresh everywhere: some ranks restored their own and
    others did not (their peers' copies and weights would not match)."""
    mine = np.array([steps, int(restored)], dtype=np.int64)
    everyone = np.empty(2 * comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(mine, everyone), "agreement on the iteration")
    steps_of, restored_of = everyone[0::2].tolist(), everyone[1::2].tolist()
    if len(set(steps_of)) > 1:
        where = ", ".join(f"rank {r} at iteration {s}" for r, s in enumerate(steps_of))
        raise ConsistencyError(
            f"ranks are at different iterations ({where}): a checkpoint was loaded on some "
            "ranks only, or the ranks' checkpoints are of different steps. Horovod's recipe loads it on rank 0 and then calls "
            "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank; per-rank "
            "checkpoints (optimizer.state_dict() of each rank) are loaded on every rank")
    return len(set(restored_of)) > 1
