"""The tensor <-> buffer bridge of the TF adapter: one list of TF variables, its flat buffers,
and the BufferAccess through which the core's SgpSession reaches them.

TF variables cannot be views into a numpy buffer, so each exchange copies: the variables are
flattened (one tensor per dtype) into the session's buffers, mixed, and assigned back. That is
two copies of the model per step on the host plus the graph/Python crossing, which
tests/tensorflow_checks.py measures; the MPI exchange itself is one fused message per peer and
dtype.
Inside a ``tf.function`` each engine call is one bridge op (bridge.py), run at the same step on
every rank, so the engine starts (a collective) inside the first one on every rank alike.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Collection, Sequence, TypeVar

import numpy as np
import tensorflow as tf

from hvd_sgp.common import adapter, finalizers, runtime
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.node import average_arrays
from hvd_sgp.common.pushsum import allocate
from hvd_sgp.tensorflow import bridge

_GOSSIP_DTYPES = (tf.float32, tf.float64)
T = TypeVar("T")


class VariableGossip:
    """One flat PushSum buffer per dtype over a fixed list of variables, and its session.
    The variables are held weakly: their model owns them, and this state goes with them."""

    def __init__(self, variables: Sequence, config: adapter.Settings):
        variables = list(variables)
        groups: "OrderedDict[tf.DType, list[int]]" = OrderedDict()
        for i, v in enumerate(variables):
            if not hasattr(v, "assign"):
                raise SgpValueError(f"source {i} ({getattr(v, 'name', type(v).__name__)}) is "
                                    "not a variable: SGP mixes variables in place")
            dtype = tf.as_dtype(v.dtype)  # Keras variables name their dtype by a string
            if dtype not in _GOSSIP_DTYPES:
                raise SgpValueError(f"variable {v.name} is {dtype.name}; SGP gossips float32 "
                                    "or float64 variables (keep float32 master weights under "
                                    "mixed precision, and use compression=fp16/bf16)")
            groups.setdefault(dtype, []).append(i)
        self._refs = [weakref.ref(v) for v in variables]
        self.groups = list(groups.items())
        self.shapes = [tf.TensorShape(v.shape) for v in variables]
        buffers = [allocate(sum(self.shapes[i].num_elements() for i in idx),
                            dtype.as_numpy_dtype) for dtype, idx in self.groups]
        signature = [(i, tuple(s.as_list()), tf.as_dtype(v.dtype).name)
                     for i, (s, v) in enumerate(zip(self.shapes, variables))]
        self.session = adapter.SgpSession(config, self, buffers, signature)
        self._loaded = False  # inside a bridge call: the buffers hold the variables' values

    @property
    def variables(self) -> list:
        alive = [ref() for ref in self._refs]
        if any(v is None for v in alive):
            raise SgpValueError("a variable that SGP gossips was deleted (its model is gone)")
        return alive

    # --- BufferAccess ---------------------------------------------------------------------
    def run(self, action: Callable[[], T]) -> T:
        """Inside a bridge call the buffers are loaded already; otherwise (an eager extra
        such as average_parameters) one bridge call loads them, runs and assigns back."""
        if self._loaded:
            return action()
        result: list = []
        self._exchange(lambda: result.append(action()), "hvd_sgp")
        return result[0]

    # --- the step -------------------------------------------------------------------------
    def reduce_gradients(self, grads: Sequence, state: Sequence = ()) -> list:
        """Begin the step and average the gradients exactly in the node (over the world in
        mode='allreduce'); None stays None.

        Under a schedule the engine may switch to AllReduce SGD at this step, averaging the
        parameters and the optimizer's floating-point ``state`` variables (momentum, Adam
        moments) first; the bridge call then carries those in and out too.
        """
        grads = [bridge.dense(g) for g in grads]
        options = self.session.settings.options
        scheduled = bool(options.schedule)
        if options.mode == "allreduce" or scheduled or self.session.layout.local.Get_size() > 1:
            return self._reduce(grads, list(state) if scheduled else [])
        scale = self.session.gradient_scale()
        if scale != 1.0:
            grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
        return grads

    def _reduce(self, grads: list, state: list) -> list:
        groups = len(self.groups)
        flats = [bridge.flatten([tf.zeros(self.shapes[i], dtype) if grads[i] is None
                                 else grads[i] for i in idx]) for dtype, idx in self.groups]
        dtypes = [d for d, _ in self.groups]
        inputs = list(flats)
        if state:
            inputs += self._flat_variables() + [tf.convert_to_tensor(v) for v in state]
            dtypes += dtypes + [tf.as_dtype(v.dtype) for v in state]

        def reduce(*arrays) -> list[np.ndarray]:
            arrays_state = [np.array(a) for a in arrays[2 * groups:]]
            if state:
                self._load(arrays[groups:2 * groups])
            self._loaded = bool(state)
            try:
                plan = self.session.begin_step(lambda: arrays_state)
                scale = self.session.gradient_scale(plan)
                flat_grads = []
                for given in arrays[:groups]:  # TF's inputs are read-only: scaled copies,
                    flat = np.empty(len(given) + 1, given.dtype)  # and the engine's element
                    np.multiply(given, scale, out=flat[:-1])
                    if plan.reduce:
                        self.session.reduce_gradients(flat)
                    flat_grads.append(flat[:-1])
            finally:
                self._loaded = False
            if not state:
                return flat_grads
            return flat_grads + [b[:-1].copy() for b in self.session.buffers] + arrays_state

        out = bridge.call(reduce, inputs, dtypes, [t.shape for t in inputs],
                          "hvd_sgp reduce_gradients")
        if state:
            self._assign(out[groups:2 * groups])
            for variable, value in zip(state, out[2 * groups:]):
                variable.assign(value)
        reduced = list(grads)
        for flat, (_, idx) in zip(out, self.groups):
            for i, part in zip(idx, bridge.unflatten(flat, [self.shapes[i] for i in idx])):
                reduced[i] = None if grads[i] is None else part
        return reduced

    def communicate(self, lr=0.0) -> None:
        """End the step with one exchange: the variables are replaced by their mixed values.
        ``lr`` (the optimizer's learning rate) feeds the metrics log's elastic estimate."""
        self._exchange(lambda rate: self.session.end_step(float(rate)), "hvd_sgp gossip",
                       [tf.cast(lr, tf.float64)])

    # --- moving values between variables and buffers ----------------------------------------
    def _flat_variables(self) -> list[tf.Tensor]:
        return [bridge.flatten([self.variables[i] for i in idx]) for _, idx in self.groups]

    def _assign(self, flats) -> None:
        for flat, (_, idx) in zip(flats, self.groups):
            for i, part in zip(idx, bridge.unflatten(flat, [self.shapes[i] for i in idx])):
                self.variables[i].assign(part)

    def _load(self, flats) -> None:
        self.session.release()  # an Overlap SGP push may still read them in place
        for buf, flat in zip(self.session.buffers, flats):
            buf[:-1] = flat

    def _exchange(self, action: Callable[..., None], what: str,
                  extra: Sequence[tf.Tensor] = ()) -> None:
        """One bridge call: load the variables' values into the buffers, run ``action`` (with
        any ``extra`` inputs as numpy values), and assign the buffers back to the variables."""
        groups = len(self.groups)

        def step(*arrays) -> list[np.ndarray]:
            self._load(arrays[:groups])
            self._loaded = True
            try:
                action(*arrays[groups:])
            finally:
                self._loaded = False
            return [buf[:-1].copy() for buf in self.session.buffers]

        flats = self._flat_variables()
        self._assign(bridge.call(step, flats + list(extra), [d for d, _ in self.groups],
                                 [f.shape for f in flats], what))


_BY_VARIABLES: dict[tuple, VariableGossip] = {}


def for_variables(variables: Sequence, config: adapter.Settings) -> VariableGossip:
    """The gossip state of exactly these variables, created at first use and then reused (a
    GradientTape is new every step; the first one's settings stand). Dropped, and its engine
    closed, when the first variable is collected."""
    key = tuple(id(v) for v in variables)
    if key not in _BY_VARIABLES:
        _BY_VARIABLES[key] = VariableGossip(variables, config)
        weakref.finalize(variables[0], _forget, key)
    return _BY_VARIABLES[key]


def _forget(key: tuple) -> None:
    gossip = _BY_VARIABLES.pop(key, None)
    if gossip is not None:  # (the key goes now: a new variable may take the id)
        finalizers.later(gossip.session.close)


def scaled(grad, factor: float):
    """``grad * factor`` for dense and sparse (IndexedSlices) gradients alike."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def finite_everywhere(grads: Sequence) -> list:
    """The gradients, made non-finite on every rank when they are non-finite on any (one
    allreduce of a flag), so that a LossScaleOptimizer skips the step and lowers its scale on
    every rank alike; None stays None."""
    grads = [None if g is None else bridge.dense(g) for g in grads]
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
    finite = tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
    everywhere, = bridge.call(lambda flag: [np.asarray(adapter.all_finite(bool(flag)))],
                              [finite], [tf.bool], [[]], "hvd_sgp all_finite")
    return [None if g is None else g + tf.where(everywhere, tf.zeros([], g.dtype),
                                                tf.constant(np.nan, g.dtype))
            for g in grads]


def average_statistics(model, local: Collection[int] = (), comm=None) -> None:
    """Replace the model's running statistics (its non-trainable floating-point variables:
    BatchNorm's moving mean and variance) by their exact average over all ranks (of ``comm``);
    variables whose id is in ``local`` stay as they are. Eager; every rank calls it."""
    variables = [v for v in model.non_trainable_variables
                 if tf.as_dtype(v.dtype).is_floating and id(v) not in local]
    values = [np.array(v.numpy()) for v in variables]
    average_arrays(values, runtime.world_comm() if comm is None else comm)
    for variable, value in zip(variables, values):
        variable.assign(value)


def shared_indices(variables: Sequence, local: Collection[int]) -> list[int]:
    """Indices of the variables SGP gossips: all but those whose id is in ``local``."""
    shared = [i for i, v in enumerate(variables) if id(v) not in local]
    if not shared:
        raise SgpValueError("every variable is registered local: SGP has nothing to gossip")
    return shared


def combine(grads: Sequence, shared: Sequence[int], reduced: Sequence,
            scale_local: bool) -> list:
    """All gradients again: the reduced ones at ``shared``, the local ones as they are, or
    scaled by 1/size with ``scale_local`` (Horovod's ``scale_local_gradients``)."""
    out = list(grads)
    for i, g in zip(shared, reduced):
        out[i] = g
    if scale_local and len(shared) < len(out):
        keep = set(shared)
        out = [g if i in keep or g is None else scaled(g, 1.0 / runtime.size())
               for i, g in enumerate(out)]
    return out
