"""``outer_optimizer=`` given a Keras optimizer: DiLoCo's outer step taken by Keras.

The core (hvd_sgp/common/outer.py) hands an ``OuterStep`` the anchors (the model at the last
sync, one flat numpy buffer per dtype) and the pseudo-gradients (anchor minus averaged model).
``KerasOuterStep`` keeps one variable per anchor, sets it to the anchor, lets the Keras
optimizer apply the pseudo-gradient to it, and copies the result back, so any Keras optimizer
(Keras 3 or tf_keras, new or legacy) moves the anchors as its own update rule says. Its
variables (momentum, iteration count) are the checkpointed state.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import numpy as np
import tensorflow as tf

from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.outer_steps import OuterStep
from hvd_sgp.tensorflow import flavour


class KerasOuterStep(OuterStep):
    """The outer step of a Keras optimizer, given as an instance or as a factory (no
    arguments -> optimizer; a fresh one is built after a restore or a repair)."""

    def __init__(self, optimizer: Union[Any, Callable[[], Any]]):
        self.factory = None if _is_optimizer(optimizer) else optimizer
        self.optimizer = optimizer if self.factory is None else None
        self.template = self.optimizer.get_config() if self.optimizer is not None else None
        self._variables: list = []
        self._pending: list = []  # a state loaded before the variables exist
        self._used = False  # the instance has variables of its own: rebuild it from its config

    def apply(self, anchors: Sequence[np.ndarray], pseudo: Sequence[np.ndarray],
              lr: float) -> None:
        if not self._variables or len(self._variables) != len(anchors):
            self._build(anchors)
        for variable, anchor in zip(self._variables, anchors):
            variable.assign(anchor)
        self.optimizer.apply_gradients(
            [(tf.constant(d), v) for d, v in zip(pseudo, self._variables)])
        for variable, anchor in zip(self._variables, anchors):
            anchor[...] = np.asarray(variable.numpy(), dtype=anchor.dtype)

    def _build(self, anchors: Sequence[np.ndarray]) -> None:
        """The optimizer (a factory's, or the instance afresh) and its variables."""
        if self.factory is not None:
            self.optimizer = self.factory()
            if not _is_optimizer(self.optimizer):
                raise SgpValueError(f"outer_optimizer's factory returned "
                                    f"{type(self.optimizer).__name__}, not a Keras optimizer")
        elif self._used:
            self.optimizer = type(self.optimizer).from_config(self.template)
        self._used = True
        make = _variable_maker(self.optimizer)
        self._variables = [make(a) for a in anchors]
        if self._pending:
            _build_slots(self.optimizer, self._variables)
            slots = flavour.optimizer_variables(self.optimizer)
            if len(slots) != len(self._pending):
                raise SgpValueError(f"outer_optimizer: the checkpoint holds {len(self._pending)}"
                                    f" optimizer variables, this Keras optimizer has "
                                    f"{len(slots)}")
            for slot, value in zip(slots, self._pending):
                slot.assign(value)
            self._pending = []

    def state(self) -> dict:
        if not self._variables:
            return {}
        return {"keras": [np.array(v.numpy())
                          for v in flavour.optimizer_variables(self.optimizer)]}

    def load_state(self, state: dict) -> None:
        self._variables = []  # built again, with these values, at the next outer step
        self._pending = [np.array(v) for v in state.get("keras", [])]

    def __repr__(self) -> str:  # the same on every rank
        if self.factory is not None:
            return f"keras:{getattr(self.factory, '__module__', '')}." \
                   f"{getattr(self.factory, '__qualname__', type(self.factory).__name__)}"
        config = {k: v for k, v in sorted(self.template.items()) if k != "name"}
        return f"keras:{type(self.optimizer).__name__}{config}"


def _is_optimizer(value: Any) -> bool:
    try:
        flavour.family(value)
    except SgpValueError:
        return False
    return True


def _variable_maker(optimizer) -> Callable[[np.ndarray], Any]:
    """Variables of the optimizer's own Keras (Keras 3 optimizers track keras.Variable)."""
    if flavour.family(optimizer) == flavour.KERAS3:
        import keras
        return lambda a: keras.Variable(a.copy(), trainable=True)
    return lambda a: tf.Variable(a.copy(), trainable=True)


def _build_slots(optimizer, variables: list) -> None:
    """Create the optimizer's variables for ``variables`` without taking a step."""
    if hasattr(optimizer, "build"):
        optimizer.build(variables)
    else:  # legacy OptimizerV2
        optimizer._create_all_weights(variables)


def with_keras_outer(sgp: dict) -> dict:
    """The SGP keywords with a Keras ``outer_optimizer`` (instance or factory) wrapped."""
    outer = sgp.get("outer_optimizer")
    if outer is None or isinstance(outer, (str, OuterStep)):
        return sgp
    if not (_is_optimizer(outer) or callable(outer)):
        return sgp  # the options table names the problem
    return {**sgp, "outer_optimizer": KerasOuterStep(outer)}
