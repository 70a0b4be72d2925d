"""DistributedOptimizer for Keras optimizers: Horovod's signature, SGP's step.

``apply``/``apply_gradients`` average the gradients exactly inside the node, take the wrapped
optimizer's ordinary local step on the de-biased variables, then run one PushSum iteration
with the node's out-peers (the core session's begin_step / end_step). It works eagerly and
inside compiled ``model.fit`` / ``tf.function`` train steps, where the exchange is one Python
op in the graph.

The wrapped optimizer is an instance of a subclass of the user's optimizer class, named like
it, so ``model.save`` writes the plain optimizer and ``load_model`` re-wraps it.
"""
from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from hvd_sgp.common import adapter
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import keyword_help
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.gossip import VariableGossip
from hvd_sgp.tensorflow.mpi_ops import Average, check_process_set, global_process_set


class _DistributedMixin(adapter.GossipMethods):
    """Put before the user's optimizer class in the MRO of the wrapped class."""

    _hvd_sgp: adapter.Settings
    _hvd_sgp_passes: int
    _hvd_sgp_sum_micro_steps: bool
    _hvd_sgp_gossip: Optional[VariableGossip]

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None and not self.built:
            return super().apply(grads, trainable_variables)  # Keras' own error
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        gossip = self._sgp_gossip(variables)
        grads = gossip.reduce_gradients(grads, self._sgp_slots())
        if self._hvd_sgp_sum_micro_steps:  # Keras averages accumulated gradients; Horovod sums
            grads = [None if g is None else g * self._hvd_sgp_passes for g in grads]
        super().apply(grads, trainable_variables)
        lr = self.learning_rate

        def communicate():
            gossip.communicate(lr)
            return tf.constant(True)

        if self._hvd_sgp_passes == 1:
            communicate()
        # Gossip only after the passes whose accumulated update was applied (``_iterations``
        # counts passes; Keras' ``iterations`` counts updates).
        elif tf.executing_eagerly():
            if int(self._iterations.numpy()) % self._hvd_sgp_passes == 0:
                communicate()
        else:
            tf.cond(self._iterations % self._hvd_sgp_passes == 0, communicate,
                    lambda: tf.constant(True))

    def _sgp_slots(self) -> list:
        """The optimizer's floating-point state (slots such as momentum), without its learning
        rate: what a schedule switch into AllReduce averages."""
        rate = getattr(self, "_learning_rate", None)
        return [v for v in self.variables
                if v is not rate and tf.as_dtype(v.dtype).is_floating]

    def _sgp_gossip(self, variables) -> VariableGossip:
        gossip = self._hvd_sgp_gossip
        if gossip is None:
            gossip = VariableGossip(variables, self._hvd_sgp)
            gossip.session.own(self)
            self._hvd_sgp_gossip = gossip
        elif [id(v) for v in gossip.variables] != [id(v) for v in variables]:
            raise SgpValueError("DistributedOptimizer was applied to a different list of "
                                "variables than at its first step; SGP gossips one fixed list")
        return gossip

    # --- the SGP extras come from adapter.GossipMethods; call them eagerly ----------------
    def _sgp_session(self) -> adapter.SgpSession:
        if self._hvd_sgp_gossip is None and not self.built:
            raise SgpValueError("the optimizer has no variables yet: train a step or call "
                                "optimizer.build(model.trainable_variables) first")
        return self._sgp_gossip(list(self._trainable_variables)).session

    def _sgp_learning_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.learning_rate))


_CLASSES: dict[type, type] = {}


def distributed_class(cls: type) -> type:
    """The wrapped subclass of a Keras optimizer class (one per class)."""
    if issubclass(cls, _DistributedMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_DistributedMixin, cls),
                             {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _CLASSES[cls]


def convert(optimizer: keras.optimizers.Optimizer, settings: adapter.Settings, passes: int = 1,
            average_aggregated_gradients: bool = False) -> keras.optimizers.Optimizer:
    """Make ``optimizer`` itself distributed (keeps its variables and state)."""
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._hvd_sgp = settings
    optimizer._hvd_sgp_passes = passes
    optimizer._hvd_sgp_sum_micro_steps = passes > 1 and not average_aggregated_gradients
    optimizer._hvd_sgp_gossip = None
    return optimizer


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=global_process_set,
                         scale_local_gradients: bool = True,
                         **sgp) -> keras.optimizers.Optimizer:
    """Wrap a Keras optimizer for SGP training; horovod.tensorflow.keras's arguments plus SGP's
    keywords (below; each also an HVD_SGP_* variable and an sgprun flag).

    Returns a new instance (from the optimizer's config) of a subclass of its class.
    ``backward_passes_per_step=k`` uses Keras' gradient accumulation (summed, or averaged
    with ``average_aggregated_gradients=True``) and gossips once per k passes.
    ``gradient_predivide_factor`` does not change an average and is accepted;
    ``sparse_as_dense``, ``num_groups``/``groups`` are accepted and unneeded (gradients are
    always fused dense, one message per dtype).
    """
    check_process_set(process_set)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise SgpValueError(f"DistributedOptimizer wraps Keras optimizers "
                            f"(tf.keras.optimizers.*), got {type(optimizer).__name__}")
    config = adapter.settings(op, compression, sgp, gradient_predivide_factor,
                              backward_passes_per_step)
    config_dict = optimizer.get_config()
    if name is not None:
        config_dict["name"] = name
    if backward_passes_per_step > 1:
        config_dict["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = type(optimizer).from_config(config_dict)
    return convert(wrapped, config, backward_passes_per_step, average_aggregated_gradients)


DistributedOptimizer.__doc__ += "\n    SGP keywords:\n" + keyword_help()
