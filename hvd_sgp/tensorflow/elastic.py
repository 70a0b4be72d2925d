"""``hvd.elastic`` for TensorFlow 2, as horovod.tensorflow.elastic: ``run``,
``TensorFlowKerasState``, ``TensorFlowState`` and ``ObjectState``. The run loop and the state
logic are the core's (hvd_sgp/common/horovod_api/elastic.py); this module copies TF variables and turns
TF's wrapping of a lost peer (an op error around our PeerLostError) back into
HorovodInternalError."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hvd_sgp.common.horovod_api import elastic as _elastic
from hvd_sgp.common import recovery, runtime
from hvd_sgp.common.errors import HorovodInternalError, SgpValueError
from hvd_sgp.tensorflow.mpi_ops import broadcast_object, broadcast_variables


def _tf_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """A lost peer met inside a TF op (a compiled train step, a collective in a graph)
    reaches Python as a TF op error; it is HorovodInternalError when ours caused it."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as error:
            if recovery.failure_pending():
                raise HorovodInternalError(str(error)) from error
            raise
    return wrapper


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` elastically: after a lost rank (fault-tolerant mode) the
    survivors repair the world in place and call it again from the recovered, synced state."""
    return _elastic.run_fn(func, _tf_errors)


class ObjectState(_elastic.ObjectState):
    """Plain Python values (keywords, kept as attributes), synced from rank 0."""

    def __init__(self, **kwargs: Any):
        super().__init__(broadcast_object, runtime.rank, **kwargs)


class _VariablesState(_elastic.ObjectState):
    """Lists of TF variables (model, optimizer) copied on commit, assigned back on restore and
    broadcast from rank 0 on sync; plain keywords as in ObjectState."""

    def __init__(self, **kwargs: Any):
        self._save_variables()
        super().__init__(broadcast_object, runtime.rank, **kwargs)

    def _groups(self) -> list[list]:
        raise NotImplementedError

    def _save_variables(self) -> None:
        self._saved_values = [[tf.identity(v) for v in group] for group in self._groups()]

    def _load_variables(self) -> None:
        for group, values in zip(self._groups(), self._saved_values):
            for variable, value in zip(group, values):
                variable.assign(value)

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        self._load_variables()
        super().restore()

    def recover(self) -> None:
        if _elastic.keeps_parameters():
            _elastic.ObjectState.restore(self)
        else:
            self.restore()

    def sync(self) -> None:
        for group in self._groups():
            if group:
                broadcast_variables(group, root_rank=0)
        self._after_sync()
        self._save_variables()
        super().sync()

    def _after_sync(self) -> None:
        """Hook: a gossiping optimizer resets its PushSum weights."""


class TensorFlowKerasState(_VariablesState):
    """The state of a Keras model and its optimizer (given, or the model's compiled one)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        if not getattr(model, "built", True):
            raise SgpValueError("the model must be built first: run model.build(input_shape) "
                                "or one training step")
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self.backend = backend
        super().__init__(**kwargs)

    def _groups(self) -> list[list]:
        optimizer = list(self.optimizer.variables) if self.optimizer is not None else []
        return [list(self.model.variables), optimizer]

    def _after_sync(self) -> None:
        if self.optimizer is not None and getattr(self.optimizer, "built", False):
            _elastic.reset_gossip(self.optimizer)


class TensorFlowState(_VariablesState):
    """The state of a list of TF variables (eager TF2)."""

    def __init__(self, variables: Optional[Sequence] = None, session=None, **kwargs: Any):
        if variables is None:
            raise SgpValueError("TensorFlowState needs its variables under TF2 (there is no "
                                "global variable collection)")
        self.variables = list(variables)
        self.session = session
        super().__init__(**kwargs)

    def _groups(self) -> list[list]:
        return [self.variables]


__all__ = ["run", "ObjectState", "TensorFlowKerasState", "TensorFlowState"]
