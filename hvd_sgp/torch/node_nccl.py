"""Exact gradient averaging inside one node over NCCL, for CUDA parameters.

The node's ranks form a torch.distributed NCCL group; its rendezvous address is agreed over
the node's MPI communicator, so no MASTER_ADDR/PORT is needed.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from hvd_sgp.common import runtime

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
        local = runtime.local_comm()
        port = local.bcast(_free_port() if local.Get_rank() == 0 else None, root=0)
        store = dist.TCPStore("127.0.0.1", port, local.Get_size(), local.Get_rank() == 0)
        if dist.is_initialized():
            _group = dist.new_group(backend="nccl")
        else:
            dist.init_process_group("nccl", store=store, rank=local.Get_rank(),
                                    world_size=local.Get_size())
            _group = dist.group.WORLD
    return _group


def average(flat: torch.Tensor) -> None:
    """In-place exact average of a CUDA tensor over the node's ranks."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=_node_group())
    flat.div_(runtime.local_size())
