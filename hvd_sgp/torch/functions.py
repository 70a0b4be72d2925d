"""Broadcasting model and optimizer state, and Python objects, as horovod.torch does."""
from __future__ import annotations

import collections
import io
from typing import Any, Optional

import torch

from hvd_sgp.common import collectives
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.torch.mpi_ops import broadcast_, global_process_set


def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite parameters (a state_dict or an iterable of (name, tensor)) with root's, in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
    else:
        raise SgpValueError("broadcast_parameters takes a state_dict or an iterable of "
                            f"(name, tensor) pairs, got {type(params).__name__}")
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise SgpValueError(f"broadcast_parameters: entry {name!r} is not a tensor")
        broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                   process_set=process_set)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set=global_process_set) -> None:
    """Give every rank root's optimizer state and hyper-parameters (lr, momentum, ...).

    The whole state_dict travels once, on the host: state entries that are tensors, scalars
    or None all arrive as they were. SGP's own state (PushSum weight, iteration) stays local.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise SgpValueError("broadcast_optimizer_state does not support LBFGS (as in Horovod)")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise SgpValueError("broadcast_optimizer_state does not support SparseAdam")
    state = optimizer.state_dict()
    state.pop("hvd_sgp", None)
    state = broadcast_object(_to_cpu(state), root_rank, process_set=process_set)
    own = optimizer.state_dict().get("hvd_sgp")
    if own is not None:
        state["hvd_sgp"] = own
    optimizer.load_state_dict(state)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Any picklable object from root (torch.save, so tensors travel as tensors)."""
    payload = None
    if collectives.runtime.rank() == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = buffer.getvalue()
    payload = collectives.broadcast_object(payload, root_rank)
    return torch.load(io.BytesIO(payload), weights_only=False)


def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> list:
    """Every rank's object, in rank order."""
    return collectives.allgather_object(obj)
