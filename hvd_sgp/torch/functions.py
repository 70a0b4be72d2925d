"""Broadcasting model and optimizer state, and Python objects, as horovod.torch does."""
from __future__ import annotations

import collections
import io
from typing import Any, Callable, Optional

import torch

from hvd_sgp.common import place
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.torch import optimizer as sgp_optimizer
from hvd_sgp.torch.mpi_ops import _broadcast_handle, global_process_set, synchronize


def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Overwrite parameters with root's, in place, in one negotiated broadcast: a state_dict,
    an iterable of (name, tensor) pairs (``model.named_parameters()``) or of tensors
    (``model.parameters()``)."""
    if isinstance(params, dict):
        tensors = [p for _, p in sorted(params.items())]
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in items]
    else:
        raise SgpValueError("broadcast_parameters takes a state_dict, an iterable of "
                            f"(name, tensor) pairs or of tensors, got {type(params).__name__}")
    tensors = [p for p in tensors if p is not None]
    bad = [type(p).__name__ for p in tensors if not isinstance(p, torch.Tensor)]
    if bad:
        raise SgpValueError(f"broadcast_parameters: expected tensors, got {bad[0]}")
    if tensors:
        synchronize(_broadcast_handle([p.data if isinstance(p, torch.nn.Parameter) else p
                                       for p in tensors], root_rank, None, process_set, True))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set=global_process_set) -> None:
    """Give every rank root's optimizer state and hyper-parameters (lr, momentum, ...).

    The whole state_dict travels once, on the host: state entries that are tensors, scalars
    or None all arrive as they were, so ``model`` (Horovod uses it to find sparse parameters)
    is not needed. An SGP optimizer takes root's shared SGP state (iteration, epoch, SlowMo)
    and starts its per-rank state afresh (PushSum weight 1, compressed gossip's copies
    reopened): with the parameters broadcast too, every rank then holds one consistent state,
    wherever root's came from (a checkpoint loaded on root only, hvd_sgp's or plain torch's).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise SgpValueError("broadcast_optimizer_state does not support LBFGS (as in Horovod)")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise SgpValueError("broadcast_optimizer_state does not support SparseAdam")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)
    state = _broadcast_state_dict(optimizer.state_dict(), root_rank, process_set)
    root_sgp = state.pop("hvd_sgp", None)
    optimizer.load_state_dict(state)  # without "hvd_sgp": per-rank SGP state untouched here
    session = getattr(optimizer, "_sgp_session", None)
    if session is not None:
        session().adopt(root_sgp or {})


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """A new optimizer has no state yet: take one local step on zero gradients, as Horovod
    does, so every rank holds state of root's structure to receive (the zero gradients stay,
    as in Horovod). Zero, also where a gradient is left: after a lost rank, hvd.elastic's
    sync comes here with each survivor's gradients of the step that failed, which would
    move the ranks apart again. An SGP DistributedOptimizer takes its wrapped class's plain
    step: no gossip, which would need every rank at once."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    if type(optimizer).__module__ == sgp_optimizer.__name__:
        super(type(optimizer), optimizer).step()
    else:
        optimizer.step()


def _broadcast_state_dict(state: dict, root_rank: int, process_set) -> dict:
    """Root's state_dict on every rank: its structure and small values pickled, its dense
    tensors (momentum, Adam's moments: the model's size or more) in one tensor broadcast, which
    moves them at the link's rate without torch.save and its copies on every rank. A rank
    whose state has root's layout (the usual case: the same model and optimizer) receives
    into its own state's tensors, without allocating the model's size again."""
    tensors: list[torch.Tensor] = []
    is_root = place.rank() == root_rank
    skeleton = _take_tensors(state, tensors, is_root)  # (here, this rank's own tensors)
    skeleton, specs = broadcast_object(
        (skeleton, [(t.shape, t.dtype) for t in tensors]) if is_root else None,
        root_rank, process_set=process_set)
    if not is_root and [(t.shape, t.dtype) for t in tensors] != specs:
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    if tensors:
        synchronize(_broadcast_handle(tensors, root_rank, None, process_set, True))
    return _put_tensors(skeleton, tensors)


class _Moved(int):
    """Where a dense tensor stood in a state_dict (its index in the tensor broadcast)."""


_MOVED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                 torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def _take_tensors(obj: Any, taken: list, values: bool) -> Any:
    """``obj`` with its dense tensors moved to ``taken`` as host tensors. Without ``values``
    (a receiving rank) they are only buffers to receive into: the tensor itself where it is on
    the host and contiguous, else a new one, without copying a GPU's state to the host."""
    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.layout == torch.strided and leaf.dtype in _MOVED_DTYPES:
            shares = leaf.device.type == "cpu" and leaf.is_contiguous()
            taken.append(leaf.detach().cpu().contiguous() if values or shares
                         else torch.empty(leaf.shape, dtype=leaf.dtype))
            return _Moved(len(taken) - 1)
        return leaf.detach().cpu()  # (sparse, complex, ...: pickled as they are)
    return _map_leaves(obj, take)


def _put_tensors(obj: Any, tensors: list) -> Any:
    return _map_leaves(obj, lambda leaf: tensors[leaf] if isinstance(leaf, _Moved) else leaf)


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``leaf`` applied below its dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {k: _map_leaves(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(v, leaf) for v in obj)
    return leaf(obj)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Any picklable object from the global rank ``root_rank`` (torch.save, so tensors travel
    as tensors)."""
    return collectives.broadcast_object(obj, root_rank, name, process_set, _dumps, _loads)


def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> list:
    """Every rank's object, in set-rank order."""
    return collectives.allgather_object(obj, name, process_set, _dumps, _loads)
