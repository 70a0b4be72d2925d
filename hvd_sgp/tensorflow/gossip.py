"""The SGP state of one list of TF variables, bridged to the core's GossipEngine.

TF variables cannot be views into a numpy buffer, so each exchange copies: the variables are
flattened (one tensor per dtype) into the engine's buffer, mixed, and assigned back. That is
two copies of the model per step on the host plus the graph/Python crossing, which
tests/tf_checks.py measures; the MPI exchange itself is one fused message per peer and dtype.

The engine is created at the first exchange, inside the bridge call: every rank reaches it at
the same step, so the engine's collective consistency check lines up across ranks.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvd_sgp.common import runtime
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.common.engine import GossipEngine
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import SgpOptions
from hvd_sgp.common.pushsum import allocate
from hvd_sgp.tensorflow import bridge

_GOSSIP_DTYPES = (tf.float32, tf.float64)


@dataclass
class Settings:
    """What a DistributedOptimizer or DistributedGradientTape was asked for."""

    options: SgpOptions
    wire: str = "none"  # the core codec: none, fp16, bf16
    sum_gradients: bool = False  # op=Sum: n times the average, as Horovod


class VariableGossip:
    """One flat PushSum buffer per dtype over a fixed list of variables."""

    def __init__(self, variables: Sequence, settings: Settings):
        self.variables = list(variables)
        self.settings = settings
        groups: "OrderedDict[tf.DType, list[int]]" = OrderedDict()
        for i, v in enumerate(self.variables):
            if not hasattr(v, "assign"):
                raise SgpValueError(f"source {i} ({getattr(v, 'name', type(v).__name__)}) is "
                                    "not a variable: SGP mixes variables in place")
            dtype = tf.as_dtype(v.dtype)  # Keras variables name their dtype by a string
            if dtype not in _GOSSIP_DTYPES:
                raise SgpValueError(f"variable {v.name} is {dtype.name}; SGP gossips float32 "
                                    "or float64 variables (keep float32 master weights under "
                                    "mixed precision, and use compression=fp16/bf16)")
            groups.setdefault(dtype, []).append(i)
        self.groups = list(groups.items())
        self.shapes = [tf.TensorShape(v.shape) for v in self.variables]
        self.buffers = [allocate(sum(self.shapes[i].num_elements() for i in idx),
                                 dtype.as_numpy_dtype) for dtype, idx in self.groups]
        self.signature = [(i, tuple(s.as_list()), tf.as_dtype(v.dtype).name)
                          for i, (s, v) in enumerate(zip(self.shapes, self.variables))]
        self._engine: Optional[GossipEngine] = None
        self._epoch = 0

    @property
    def engine(self) -> GossipEngine:
        if self._engine is None:
            self._engine = GossipEngine(self.buffers, self.settings.options, self.signature,
                                        self.settings.wire)
            self._engine.set_epoch(self._epoch)
        return self._engine

    def set_epoch(self, epoch: int) -> None:
        """The epoch for an epoch-based schedule (kept until the engine starts)."""
        self._epoch = int(epoch)
        if self._engine is not None:
            self._engine.set_epoch(self._epoch)

    def drain(self) -> None:
        """Sum in the messages still in flight (Overlap SGP); none before the first exchange.
        Call eagerly on every rank."""
        if self._engine is not None:
            self._exchange(self._engine_step(GossipEngine.drain), "hvd_sgp drain")

    def metrics(self) -> dict:
        """The engine's per-rank figures; local only (no engine is created for them)."""
        if self._engine is None:
            return {"weight": 1.0, "wait_seconds": 0.0, "total_wait_seconds": 0.0,
                    "bytes_sent": 0, "iteration": 0}
        return self._engine.metrics()

    def state(self) -> dict:
        """PushSum weights and iteration (local only, like metrics)."""
        if self._engine is None:
            n = len(self.buffers)
            return {"iteration": 0, "epoch": self._epoch, "weights": [1.0] * n}
        return self._engine.state()

    def reduce_gradients(self, grads: Sequence, state: Sequence = ()) -> list:
        """Exact in-node average (world average in mode='allreduce'); None stays None.

        Under a schedule the engine may switch to AllReduce SGD at this step and average the
        parameters first; the bridge call then also carries the variables and the optimizer's
        floating-point ``state`` variables (momentum, Adam moments) in and out, and the state is averaged
        too, so every rank takes the same steps from there on.
        """
        grads = [bridge.dense(g) for g in grads]
        options = self.settings.options
        scheduled = bool(options.schedule)
        if options.mode == "allreduce" or scheduled or runtime.local_size() > 1:
            flats = [bridge.flatten([tf.zeros(self.shapes[i], dtype) if grads[i] is None
                                     else grads[i] for i in idx]) for dtype, idx in self.groups]
            dtypes = [d for d, _ in self.groups]
            state = list(state) if scheduled else []
            if scheduled:
                flats += self._flat_variables() + [tf.convert_to_tensor(v) for v in state]
                dtypes += dtypes + [tf.as_dtype(v.dtype) for v in state]
            out = bridge.call(self._reduce, flats, dtypes, [f.shape for f in flats],
                              "hvd_sgp reduce_gradients")
            if scheduled:
                groups = len(self.groups)
                self._assign(out[groups:2 * groups])
                for variable, value in zip(state, out[2 * groups:]):
                    variable.assign(value)
            reduced = list(grads)
            for flat, (_, idx) in zip(out, self.groups):
                parts = bridge.unflatten(flat, [self.shapes[i] for i in idx])
                for i, part in zip(idx, parts):
                    reduced[i] = None if grads[i] is None else part
            grads = reduced
        if self.settings.sum_gradients:
            grads = [None if g is None else g * tf.cast(runtime.size(), g.dtype) for g in grads]
        return grads

    def _reduce(self, *arrays) -> list[np.ndarray]:
        groups = len(self.groups)
        grads = [np.array(a) for a in arrays[:groups]]  # TF's inputs are read-only
        if len(arrays) == groups:
            for g in grads:
                self.engine.reduce_gradients(g)
            return grads
        self._load(arrays[groups:2 * groups])
        state = [np.array(a) for a in arrays[2 * groups:]]
        before = self.engine.stage.mode
        if self.engine.mode == "allreduce" and before != "allreduce":  # switched at this step
            state = [collectives.allreduce(a) for a in state]
        for g in grads:
            self.engine.reduce_gradients(g)
        return grads + [buf[:-1].copy() for buf in self.buffers] + state

    def communicate(self, lr=0.0) -> None:
        """One PushSum iteration: the variables are replaced by their mixed values. ``lr``
        (the optimizer's learning rate) feeds the metrics log's elastic estimate."""
        self._exchange(self._engine_step(lambda e, rate: e.communicate(float(rate))),
                       "hvd_sgp gossip", [tf.cast(lr, tf.float64)])

    def average(self) -> None:
        """Exact consensus over all ranks (every rank must call it)."""
        self._exchange(self._engine_step(GossipEngine.average_parameters),
                       "hvd_sgp average_parameters")

    def consensus(self, lr: float) -> dict:
        """One allreduce: deviation from the network mean, consensus distance, elastic
        estimate. Call eagerly on every rank."""
        result: dict = {}
        self._exchange(self._engine_step(lambda e: result.update(e.consensus(lr))),
                       "hvd_sgp consensus")
        return result

    def _flat_variables(self) -> list[tf.Tensor]:
        return [bridge.flatten([self.variables[i] for i in idx]) for _, idx in self.groups]

    def _assign(self, flats) -> None:
        for flat, (_, idx) in zip(flats, self.groups):
            for i, part in zip(idx, bridge.unflatten(flat, [self.shapes[i] for i in idx])):
                self.variables[i].assign(part)

    def _exchange(self, step, what: str, extra: Sequence[tf.Tensor] = ()) -> None:
        """Run a bridge ``step`` on the variables' values (and ``extra`` inputs); assign back."""
        flats = self._flat_variables()
        self._assign(bridge.call(step, flats + list(extra), [d for d, _ in self.groups],
                                 [f.shape for f in flats], what))

    def _load(self, flats) -> None:
        for buf, flat in zip(self.buffers, flats):
            buf[:-1] = flat

    def _engine_step(self, action: Callable[..., None]):
        """A bridge function: load the variables' values, run ``action`` on the engine (with
        any extra inputs), and return the buffers' (mixed) values to assign back."""
        def step(*arrays) -> list[np.ndarray]:
            self._load(arrays[:len(self.groups)])
            action(self.engine, *arrays[len(self.groups):])
            return [buf[:-1].copy() for buf in self.buffers]
        return step


_BY_VARIABLES: dict[tuple, VariableGossip] = {}


def for_variables(variables: Sequence, settings: Settings) -> VariableGossip:
    """The gossip state of exactly these variables, created at first use and then reused (a
    GradientTape is new every step; the first one's settings stand)."""
    key = tuple(id(v) for v in variables)
    if key not in _BY_VARIABLES:
        _BY_VARIABLES[key] = VariableGossip(variables, settings)
    return _BY_VARIABLES[key]
