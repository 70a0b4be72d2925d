"""DistributedOptimizer: Horovod's signature, SGP's step.

``step()`` averages gradients exactly inside the node, takes the wrapped optimizer's ordinary
local step on the de-biased parameters, then runs one PushSum iteration with the node's
out-peers. The model's parameters always hold the de-biased values.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hvd_sgp.common import adapter
from hvd_sgp.common.node import average_arrays
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import keyword_help
from hvd_sgp.common.outer_steps import OuterStep
from hvd_sgp.torch import node_nccl
from hvd_sgp.torch import compression as compression_module
from hvd_sgp.torch.compression import Compression
from hvd_sgp.torch.flat import group_parameters, staged
from hvd_sgp.torch.mpi_ops import Average, global_process_set


class StagedAccess:
    """The engine's view of the parameters: staged groups copy out before and back after
    (see flat.staged); the other placements mix the parameters' own memory."""

    def __init__(self, groups):
        self.groups = groups

    def run(self, action):
        with staged(self.groups):
            return action()


class _DistributedOptimizer(adapter.GossipMethods, torch.optim.Optimizer):
    """Mixed into a subclass of the user's optimizer class (see DistributedOptimizer)."""

    def __init__(self, params, named_parameters, backward_passes_per_step,
                 config: adapter.Settings):
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _check_named_parameters(named_parameters, all_params)
        if len({id(p) for p in all_params}) != len(all_params):
            raise SgpValueError("a parameter appears in more than one param group")
        self.backward_passes_per_step = backward_passes_per_step
        self._groups = group_parameters(all_params)
        signature = [(self._parameter_names.get(id(p), i), tuple(p.shape), str(p.dtype))
                     for i, p in enumerate(all_params)]
        self._session = adapter.SgpSession(config, StagedAccess(self._groups),
                                           [g.buffer for g in self._groups], signature)
        self._session.start_at_wrapping()  # ranks compare their models and options now
        self._session.own(self)
        self._passes = {}
        self._counted = {id(p) for p in all_params if p.requires_grad}  # hooked below
        self._unreached: list[list[torch.nn.Parameter]] = [[] for _ in self._groups]
        self._reached: Optional[set] = None  # ids backward reached since a view-keeping zero_grad
        count = weakref.WeakMethod(self._count_pass)  # the model may outlive the optimizer
        self._hooks = [p.register_post_accumulate_grad_hook(
                           lambda p: count() is not None and count()(p))
                       for p in all_params if p.requires_grad]
        weakref.finalize(self, lambda hooks: [h.remove() for h in hooks], self._hooks)
        self._synchronized = False
        self._should_skip = False

    # --- Horovod's gradient bookkeeping -------------------------------------------------
    def _count_pass(self, p: torch.Tensor) -> None:
        if self._reached is not None:
            self._reached.add(id(p))
        count = self._passes.get(p, 0) + 1
        if count > self.backward_passes_per_step:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._passes[p] = count

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise SgpValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Average gradients exactly within the node (across the world in mode='allreduce').
        The backward passes are counted afresh after it, also when it fails: a lost peer
        (under hvd.elastic.run) abandons the step, and the next one starts from its own."""
        try:
            self._drop_unreached()
            for group in self._groups:
                group.check_views()
            plan = self._session.begin_step(self._floating_state)
            scale = self._session.gradient_scale(plan)  # rides in the copy into the buffer
            if plan.reduce:
                for group in self._groups:
                    if group.device.type == "cuda" and plan.mode != "allreduce" \
                            and self._session.settings.layout is None and node_nccl.usable():
                        self._session.reduce_gradients(group.gather_grads(scale),
                                                       node_nccl.allreduce_sum)
                        group.scatter_grads()
                    else:
                        self._session.reduce_gradients(group.grads_for_mpi(scale))
                        group.grads_from_mpi()
            elif scale != 1.0:
                for p in self._all_params():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        finally:
            self._passes.clear()
        self._synchronized = True

    def _floating_state(self) -> list:
        """The optimizer's floating-point state (momentum, Adam moments): what entering
        AllReduce SGD averages."""
        return [value for state in self.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.is_floating_point()]

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use between synchronize() and step(), e.g. to clip the synchronized gradients."""
        self._should_skip = True
        try:
            yield
        finally:
            self._should_skip = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Torch's zero_grad, except that with ``set_to_none`` (torch's default) gradients that
        are views of the flat gradient buffer stay, zeroed (torch DDP's
        ``gradient_as_bucket_view``): backward accumulates into the buffer, with no fresh
        tensors to allocate and no copy into the buffer. A parameter that no backward reaches
        before the step gets None back there (synchronize), so optimizers skip it as they
        would after torch's zero_grad."""
        kept = [[p for p in group.holding_views() if id(p) in self._counted] if set_to_none
                 else []
                for group in self._groups]
        for group in self._groups:  # autograd's gradients go when they went without the views
            group.release_replaced()
        super(self.__class__, self).zero_grad(set_to_none)
        for group, params in zip(self._groups, kept):
            group.zero_views(params)
        self._unreached = kept
        self._reached = set() if any(kept) else None

    def _drop_unreached(self) -> None:
        """None for the kept views that no backward reached since zero_grad."""
        if self._reached is None:
            return
        for group, params in zip(self._groups, self._unreached):
            group.drop_views([p for p in params if id(p) not in self._reached])
        self._unreached = [[] for _ in self._groups]
        self._reached = None

    # torch.amp.GradScaler then calls step() even when it found inf/NaN gradients (handing us
    # ``found_inf``), so a node that skips its local update still gossips: its peers never wait
    # for an exchange that does not come.
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        loss = None
        if closure is not None:  # its backward first: the exchange below averages its gradients
            with torch.enable_grad():
                loss = closure()
        scaling = {key: self.__dict__.pop(key) for key in ("grad_scale", "found_inf")
                   if key in self.__dict__}  # set by GradScaler.step; it deletes them after
        try:
            if self._should_skip:
                if not self._synchronized:
                    self.synchronize()
            elif self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
            else:
                self.synchronize()
            self._synchronized = False
            if self._unscale(scaling.get("grad_scale"), scaling.get("found_inf")):
                super(self.__class__, self).step()
            self._session.end_step(self.param_groups[0]["lr"])
            return loss
        finally:
            self.__dict__.update(scaling)

    def _unscale(self, scale, found_inf) -> bool:
        """Under GradScaler: whether to take the local step, unscaling the gradients first
        where GradScaler left them scaled (``scale``: step() without unscale_()). The check
        runs on the reduced gradients, so every rank of a node decides alike."""
        if found_inf is not None and bool(found_inf.item()):
            return False
        if scale is None:
            return True
        params = [p for p in self._all_params() if p.grad is not None]
        values = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params]
        if values and not bool(torch.stack([v.isfinite().all() for v in values]).all()):
            return False
        for p in params:
            if p.grad.is_sparse:
                p.grad = p.grad / scale.to(p.grad.device)
            else:
                p.grad.div_(scale.to(p.grad.device))
        return True

    def _all_params(self):
        return [p for group in self._groups for p in group.params]

    # --- the SGP extras come from adapter.GossipMethods -----------------------------------
    def _sgp_session(self) -> adapter.SgpSession:
        return self._session

    def _sgp_learning_rate(self) -> float:
        return self.param_groups[0]["lr"]

    def _sgp_average_statistics(self, model: torch.nn.Module) -> None:
        average_arrays([b for b in model.buffers() if b.is_floating_point()],
                       self._session.layout.world)

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["hvd_sgp"] = _as_tensors(self._session.state())
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        sgp_state = state_dict.pop("hvd_sgp", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if sgp_state is not None:
            self._session.load_state(sgp_state)


class TorchOuterStep(OuterStep):
    """``outer_optimizer=`` given a torch optimizer factory (params -> Optimizer): the
    optimizer it builds over the anchors (one flat CPU tensor per dtype buffer, sharing the
    core's memory) steps with the pseudo-gradients as their ``.grad``. Its ``state_dict()``
    is the checkpointed state."""

    def __init__(self, factory: Callable[[list], torch.optim.Optimizer]):
        self.factory = factory
        self.optimizer = None
        self._anchors: list = []  # what the optimizer's parameters alias
        self._params: list = []
        self._pending: dict = {}  # a state loaded before the optimizer exists

    def apply(self, anchors: Sequence[np.ndarray], pseudo: Sequence[np.ndarray],
              lr: float) -> None:
        if self.optimizer is None or any(a is not b for a, b in zip(anchors, self._anchors)):
            self._params = [torch.from_numpy(a) for a in anchors]
            self.optimizer = self.factory(list(self._params))
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise SgpValueError(f"outer_optimizer's factory returned "
                                    f"{type(self.optimizer).__name__}, not a torch optimizer")
            self._anchors = list(anchors)
            if self._pending:
                self.optimizer.load_state_dict(self._pending)
                self._pending = {}
        for p, d in zip(self._params, pseudo):
            p.grad = torch.from_numpy(d)
        self.optimizer.step()

    def state(self) -> dict:
        return {} if self.optimizer is None else {"torch": self.optimizer.state_dict()}

    def load_state(self, state: dict) -> None:
        self.optimizer, self._anchors = None, []  # built again over the restored anchors
        self._pending = state.get("torch", {})

    def __repr__(self) -> str:  # the same on every rank
        factory = self.factory
        return f"torch:{getattr(factory, '__module__', '')}." \
               f"{getattr(factory, '__qualname__', type(factory).__name__)}"


def _as_tensors(value):
    """The SGP state with its numpy arrays (SlowMo's, compressed gossip's copies) as CPU
    tensors: ``torch.load``'s default (weights_only) reads tensors, not numpy objects."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: _as_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_tensors(v) for v in value)
    return value


def _check_named_parameters(named_parameters, all_params) -> dict:
    """Horovod's checks: (name, parameter) tuples, unique names, every parameter named."""
    if named_parameters is None:
        return {}
    named_parameters = list(named_parameters)
    if any(not isinstance(p, tuple) or len(p) != 2 for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [name for name, _ in named_parameters]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(duplicates)}")
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [id(p) for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
    return {id(p): name for name, p in named_parameters}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set, **sgp) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for SGP training; same arguments as horovod.torch's, plus SGP's
    keywords (below; each also an HVD_SGP_* variable and an sgprun flag).

    Returns an instance of a subclass of the optimizer's class, so isinstance checks, LR
    schedulers and param_groups keep working. ``num_groups``/``groups`` (Horovod's fusion
    groups) are accepted and unneeded: all parameters already travel as one buffer. Sparse
    gradients are averaged densely where they must be (in-node, or mode='allreduce') and handed
    back sparse, which is what Horovod's ``sparse_as_dense=True`` does (accepted; here it is
    always so).
    """
    outer = sgp.get("outer_optimizer")
    if callable(outer) and not isinstance(outer, OuterStep):
        sgp = {**sgp, "outer_optimizer": TorchOuterStep(outer)}
    config = adapter.settings(op, compression, sgp, gradient_predivide_factor,
                              backward_passes_per_step, compression_module.TENSORS, process_set)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise SgpValueError("LBFGS re-evaluates its closure many times per step and is not "
                            "supported by DistributedOptimizer")
    cls = type(optimizer.__class__.__name__, (adapter.GossipMethods, optimizer.__class__),
               dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named_parameters, backward_passes_per_step, config)
    wrapped.load_state_dict(optimizer.state_dict())
    return wrapped


DistributedOptimizer.__doc__ += "\n    SGP keywords:\n" + keyword_help()
