"""DistributedOptimizer for Keras optimizers, Keras 3 and tf_keras: Horovod's signature, SGP's step.

Each step averages the gradients exactly inside the node (the core session's begin_step), takes
the wrapped optimizer's ordinary local step on the de-biased variables, then runs one PushSum
iteration with the node's out-peers (end_step). Keras 3 optimizers step through ``apply``,
tf_keras' (new and legacy ``OptimizerV2``) through ``apply_gradients`` (flavour.py). It works
eagerly and inside compiled ``model.fit`` / ``tf.function`` train steps, where each exchange is
one Python op in the graph.

Local variables (``register_local_var``, Horovod's): their gradients are not averaged (only
scaled by 1/size with ``scale_local_gradients``, as Horovod does) and SGP neither gossips nor
averages them: every rank keeps its own.

Mixed precision: a LossScaleOptimizer skips the steps whose gradients overflow and lowers its
scale. Under SGP each rank sees only its own gradients, so the wrapper first agrees with every
rank (one allreduce of a flag) and an overflow on any rank makes every rank skip: the loss
scale stays identical and the exchanges keep pairing up. Wrap the LossScaleOptimizer:
``hvd.DistributedOptimizer(LossScaleOptimizer(opt))``. tf_keras' compile wraps the other way
round under a mixed_float16 policy, which works too (its LossScaleOptimizer aggregates through
the inner optimizer before it decides); Keras 3's decides first, and that order is refused with
the fix.

The wrapped optimizer is an instance of a subclass of the user's optimizer class, named like
it, so ``model.save`` writes the plain optimizer and ``load_model`` re-wraps it.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import numpy as np
import tensorflow as tf

from hvd_sgp.common import adapter
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import keyword_help
from hvd_sgp.tensorflow import flavour, gossip
from hvd_sgp.tensorflow import compression as compression_module
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.gossip import VariableGossip
from hvd_sgp.tensorflow.mpi_ops import Average, global_process_set
from hvd_sgp.tensorflow.outer import with_keras_outer


class _SgpOptimizer(adapter.GossipMethods):
    """What both Kerases' wrapped classes share; put before the user's class in the MRO."""

    _hvd_sgp: adapter.Settings
    _hvd_sgp_passes: int
    _hvd_sgp_sum_micro_steps: bool
    _hvd_sgp_gossip: Optional[VariableGossip]
    _hvd_sgp_local: set  # ids of the variables registered local
    _hvd_sgp_scale_local: bool
    _hvd_sgp_epoch = 0

    def register_local_var(self, var) -> None:
        """Horovod's: ``var`` is this worker's own. Its gradient is not averaged (scaled by
        1/size when ``scale_local_gradients``), and SGP neither gossips nor averages it.
        Register before the first step: SGP gossips the list of variables it saw then."""
        if self._hvd_sgp_gossip is not None:
            raise SgpValueError("register_local_var() must come before the first step: SGP "
                                "already gossips the variables it saw then")
        self._hvd_sgp_local.add(id(var))

    def _sgp_gossip(self, variables) -> VariableGossip:
        current = self._hvd_sgp_gossip
        if current is None:
            current = VariableGossip(variables, self._hvd_sgp)
            current.session.own(self)
            current.session.set_epoch(self._hvd_sgp_epoch)
            current.session.resume_at = self._sgp_saved_steps()
            self._hvd_sgp_gossip = current
        elif [id(v) for v in current.variables] != [id(v) for v in variables]:
            raise SgpValueError("DistributedOptimizer was applied to a different list of "
                                "variables than at its first step; SGP gossips one fixed list")
        return current

    def _sgp_saved_steps(self) -> int:
        """The optimizer's count of updates (``iterations``): restored with the model by
        hvd.load_model, it is where SGP's iteration resumes (read eagerly: this runs while
        a train step is traced)."""
        with tf.init_scope():
            return int(np.asarray(tf.convert_to_tensor(self.iterations)))

    def _sgp_slots(self) -> list:
        """The optimizer's floating-point state (slots such as momentum), without its learning
        rate: what a schedule switch into AllReduce averages."""
        rates = {id(getattr(self, "_learning_rate", None))}
        hyper = getattr(self, "_hyper", None)  # legacy OptimizerV2 keeps it there
        if isinstance(hyper, dict):
            rates.add(id(hyper.get("learning_rate")))
        return [v for v in flavour.optimizer_variables(self)
                if id(v) not in rates and tf.as_dtype(v.dtype).is_floating]

    def _sgp_begin(self, grads: list, variables: list) -> list:
        """Begin the step: the shared variables' gradients averaged in the node (or the
        world), the local ones scaled as Horovod does; under a loss scaler, made non-finite
        everywhere when they are anywhere."""
        shared = gossip.shared_indices(variables, self._hvd_sgp_local)
        state = self._sgp_gossip([variables[i] for i in shared])
        reduced = state.reduce_gradients([grads[i] for i in shared], self._sgp_slots())
        out = gossip.combine(grads, shared, reduced, self._hvd_sgp_scale_local)
        if flavour.is_loss_scale(self) or self._sgp_inside_loss_scale():
            out = gossip.finite_everywhere(out)
        if self._hvd_sgp_sum_micro_steps:  # Keras averages accumulated gradients; Horovod sums
            out = [None if g is None else g * self._hvd_sgp_passes for g in out]
        return out

    def _sgp_inside_loss_scale(self) -> bool:
        return False

    def _sgp_end(self) -> None:
        """End the step with one exchange (once per ``backward_passes_per_step`` passes)."""
        state = self._hvd_sgp_gossip
        lr = self._sgp_rate()

        def communicate():
            state.communicate(lr)
            return tf.constant(True)

        if self._hvd_sgp_passes == 1:
            communicate()
        # Gossip only after the passes whose accumulated update was applied (Keras 3's
        # ``_iterations`` counts passes; ``iterations`` counts updates).
        elif tf.executing_eagerly():
            if int(self._iterations.numpy()) % self._hvd_sgp_passes == 0:
                communicate()
        else:
            tf.cond(self._iterations % self._hvd_sgp_passes == 0, communicate,
                    lambda: tf.constant(True))

    def _sgp_rate(self):
        """The current learning rate (a schedule evaluated at the current iteration)."""
        rate = self.learning_rate
        if callable(rate) and not hasattr(rate, "dtype"):
            rate = rate(self.iterations)
        return rate

    # --- the SGP extras come from adapter.GossipMethods; call them eagerly ----------------
    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch-based schedule (HVD_SGP_SCHEDULE) which epoch runs; before the first
        step too (a resumed fit starts at its initial epoch)."""
        self._hvd_sgp_epoch = int(epoch)
        if self._hvd_sgp_gossip is not None:
            super().set_epoch(epoch)

    def _sgp_average_statistics(self, model) -> None:
        gossip.average_statistics(model, self._hvd_sgp_local,  # local variables stay own
                                  self._sgp_session().layout.world)

    def _sgp_session(self) -> adapter.SgpSession:
        if self._hvd_sgp_gossip is None:
            raise SgpValueError("the optimizer has no variables yet: train a step first")
        return self._hvd_sgp_gossip.session

    def _sgp_learning_rate(self) -> float:
        return float(np.asarray(tf.convert_to_tensor(self._sgp_rate())))


class _Keras3Optimizer(_SgpOptimizer):
    """Keras 3: the step is ``apply(grads, trainable_variables)``."""

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None and not self.built:
            return super().apply(grads, trainable_variables)  # Keras' own error
        if self._sgp_applied_by_loss_scale():
            raise SgpValueError(
                "hvd.DistributedOptimizer is inside a LossScaleOptimizer (compile adds one under "
                "a mixed_float16 policy), which skips steps rank by rank; wrap it the other way "
                "round: hvd.DistributedOptimizer(keras.mixed_precision.LossScaleOptimizer(opt))")
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        grads = self._sgp_begin(list(grads), variables)
        super().apply(grads, trainable_variables)
        self._sgp_end()

    def _sgp_applied_by_loss_scale(self) -> bool:
        """Whether a LossScaleOptimizer around this one is applying it, from the branch it
        takes for finite gradients only (looked up on the Python stack: once per trace)."""
        frame = inspect.currentframe()
        while frame is not None:
            outer = frame.f_locals.get("self")
            if outer is not self and getattr(outer, "inner_optimizer", None) is self:
                return True
            frame = frame.f_back
        return False

    def _sgp_session(self) -> adapter.SgpSession:
        if self._hvd_sgp_gossip is None and self.built:
            variables = list(self._trainable_variables)
            shared = gossip.shared_indices(variables, self._hvd_sgp_local)
            self._sgp_gossip([variables[i] for i in shared])
        if self._hvd_sgp_gossip is None:
            raise SgpValueError("the optimizer has no variables yet: train a step or call "
                                "optimizer.build(model.trainable_variables) first")
        return self._hvd_sgp_gossip.session


class _TfKerasOptimizer(_SgpOptimizer):
    """tf_keras (new and legacy optimizers): the step is ``apply_gradients(grads_and_vars)``.

    Inside a LossScaleOptimizer (tf_keras' compile adds one under mixed_float16) the outer
    optimizer calls this one's gradient aggregation on every step, then ``apply_gradients``
    only where the gradients are finite: the step begins in the aggregation, so every rank
    agrees first, and the exchange runs inside ``apply_gradients`` on all ranks or none.
    """

    _hvd_sgp_begun = False

    def _sgp_inside_loss_scale(self) -> bool:
        return bool(getattr(self, "_is_wrapped_by_loss_scale_optimizer", False))

    def _sgp_aggregated(self, grads_and_vars):
        if not self._sgp_inside_loss_scale():
            return grads_and_vars
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        grads = self._sgp_begin([g for g, _ in pairs], variables)
        self._hvd_sgp_begun = True
        return list(zip(grads, variables))

    def aggregate_gradients(self, grads_and_vars):
        return self._sgp_aggregated(super().aggregate_gradients(grads_and_vars))

    def _aggregate_gradients(self, grads_and_vars):
        return self._sgp_aggregated(super()._aggregate_gradients(grads_and_vars))

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        if not pairs:
            return super().apply_gradients(pairs, *args, **kwargs)
        variables = [v for _, v in pairs]
        grads = [g for g, _ in pairs]
        if self._sgp_inside_loss_scale():
            if not self._hvd_sgp_begun:
                raise SgpValueError("inside a LossScaleOptimizer, apply its apply_gradients "
                                    "with gradient aggregation on (the default)")
            self._hvd_sgp_begun = False
        else:
            grads = self._sgp_begin(grads, variables)
        result = super().apply_gradients(list(zip(grads, variables)), *args, **kwargs)
        self._sgp_end()
        return result


_MIXINS = {flavour.KERAS3: _Keras3Optimizer, flavour.TF_KERAS: _TfKerasOptimizer,
           flavour.TF_KERAS_LEGACY: _TfKerasOptimizer}
_CLASSES: dict[type, type] = {}


def distributed_class(optimizer) -> type:
    """The wrapped subclass of the optimizer's class (one per class)."""
    cls = type(optimizer)
    if issubclass(cls, _SgpOptimizer):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_MIXINS[flavour.family(optimizer)], cls),
                             {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _CLASSES[cls]


def convert(optimizer, settings: adapter.Settings, passes: int = 1,
            average_aggregated_gradients: bool = False, scale_local_gradients: bool = True):
    """Make ``optimizer`` itself distributed (keeps its variables and state)."""
    optimizer.__class__ = distributed_class(optimizer)
    optimizer._hvd_sgp_passes = passes
    optimizer._hvd_sgp_sum_micro_steps = passes > 1 and not average_aggregated_gradients
    optimizer._hvd_sgp_gossip = None
    optimizer._hvd_sgp_local = set()
    optimizer._hvd_sgp_scale_local = scale_local_gradients
    optimizer._hvd_sgp = settings  # last: from here on the optimizer counts as wrapped
    return optimizer


def check_groups(num_groups: int, groups) -> None:
    """Horovod's checks of ``num_groups`` / ``groups`` (accepted; SGP always fuses)."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise SgpValueError("groups should be a non-negative integer or a list of list of "
                            "tf.Variable.")


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op=Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=global_process_set,
                         scale_local_gradients: bool = True, **sgp):
    """Wrap a Keras optimizer (Keras 3 or tf_keras, new or legacy) for SGP training;
    horovod.tensorflow.keras's arguments, in its order, plus SGP's keywords (below; each also
    an HVD_SGP_* variable and an sgprun flag).

    Returns a new instance (from the optimizer's config) of a subclass of its class.
    ``backward_passes_per_step=k`` uses Keras 3's gradient accumulation (summed, or averaged
    with ``average_aggregated_gradients=True``) and gossips once per k passes.
    ``gradient_predivide_factor`` does not change an average and is accepted;
    ``device_dense``/``device_sparse`` (exchanges go through host memory), ``sparse_as_dense``
    and ``num_groups``/``groups`` are accepted and unneeded (gradients are always fused
    dense, one message per dtype).
    """
    kind = flavour.family(optimizer)
    check_groups(num_groups, groups)
    config = adapter.settings(op, compression, with_keras_outer(sgp),
                              gradient_predivide_factor, backward_passes_per_step,
                              compression_module.TENSORS, process_set)
    if backward_passes_per_step > 1 and kind != flavour.KERAS3:
        raise SgpValueError("backward_passes_per_step > 1 needs a Keras 3 optimizer (its "
                            "gradient accumulation); tf_keras optimizers take one pass per step")
    config_dict = optimizer.get_config()
    if name is not None:
        config_dict["name"] = name
    if backward_passes_per_step > 1:
        config_dict["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = type(optimizer).from_config(config_dict)
    return convert(wrapped, config, backward_passes_per_step, average_aggregated_gradients,
                   scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op=Average,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients: bool = True, **sgp):
    """Horovod's: DistributedOptimizer with the trainable weights of ``local_layers`` (a layer
    or a list of layers) registered local (see ``register_local_var``)."""
    local_variables = local_layer_variables(local_layers)
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                   sparse_as_dense, gradient_predivide_factor, op,
                                   groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients, **sgp)
    for variable in local_variables:
        wrapped.register_local_var(variable)
    return wrapped


def local_layer_variables(local_layers) -> list:
    """The trainable weights of Horovod's ``local_layers`` argument (None, a layer, a list)."""
    if local_layers is None:
        return []
    if flavour.is_layer(local_layers):
        local_layers = [local_layers]
    elif not all(flavour.is_layer(layer) for layer in local_layers):
        raise SgpValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


DistributedOptimizer.__doc__ += "\n    SGP keywords:\n" + keyword_help()
