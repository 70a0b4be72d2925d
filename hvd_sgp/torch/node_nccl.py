"""Exact gradient averaging inside one node over NCCL, for CUDA parameters.

The node's ranks form a torch.distributed NCCL group; its rendezvous address is agreed over
the node's MPI communicator, so no MASTER_ADDR/PORT is needed.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from hvd_sgp.common import node, runtime
from hvd_sgp.common.errors import SgpValueError

_group = None


def usable() -> bool:
    return (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
            and runtime.local_size() > 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_group():
    global _group
    if _group is None:
        _group = _user_world_subgroup() if dist.is_initialized() else _own_node_world()
    return _group


def _own_node_world():
    """A torch.distributed world of this node's ranks only."""
    first = runtime.local_rank() == 0
    port = node.broadcast_in_node(_free_port() if first else None)
    store = dist.TCPStore("127.0.0.1", port, runtime.local_size(), first)
    dist.init_process_group("nccl", store=store, rank=runtime.local_rank(),
                            world_size=runtime.local_size())
    return dist.group.WORLD


def _user_world_subgroup(backend: str = "nccl"):
    """The script started torch.distributed itself: split its world into one group per node
    (every rank takes part in creating every group, as torch requires)."""
    if dist.get_world_size() != runtime.size():
        raise SgpValueError(
            f"torch.distributed was initialized with {dist.get_world_size()} ranks but MPI has "
            f"{runtime.size()}; hvd_sgp needs the same processes in both")
    group, _ = dist.new_subgroups_by_enumeration(node.gather_by_node(dist.get_rank()),
                                                 backend=backend)
    return group


def allreduce_sum(flat: torch.Tensor) -> None:
    """In-place sum of a CUDA tensor over the node's ranks (the caller pre-scaled it)."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=_node_group())
