"""DistributedGradientTape: SGP for custom training loops that call ``tape.gradient``.

A tape has no optimizer step after which to gossip, so it mixes when the gradients are taken:
``gradient()`` computes the gradients at the current variables z_k, averages them exactly in
the node, then replaces the variables by their PushSum-mixed values and returns the gradients
for the user's ``apply_gradients``. The update is z_{k+1} = mix(z_k) - lr * g(z_k), the
"combine, then adapt with the pre-mix gradient" form of decentralised SGD (as D-PSGD): the
gradient and the exchange could overlap, and at consensus it is the same fixed point as SGP.

Sources registered local (``register_local_source``, or ``PartialDistributedGradientTape``'s
``local_layers``) are this rank's own: their gradients are not averaged (scaled by 1/size with
``scale_local_gradients``, as Horovod does) and SGP does not mix them.
"""
from __future__ import annotations

import tensorflow as tf

from hvd_sgp.common import adapter
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.common.options import keyword_help
from hvd_sgp.tensorflow import gossip
from hvd_sgp.tensorflow.optimizer import check_groups, local_layer_variables
from hvd_sgp.tensorflow import compression as compression_module
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.mpi_ops import Average, global_process_set
from hvd_sgp.tensorflow.outer import with_keras_outer


class _DistributedTapeMixin:
    _hvd_sgp: adapter.Settings
    _hvd_sgp_local: set  # ids of the local sources
    _hvd_sgp_scale_local: bool

    def register_local_source(self, source) -> None:
        """Horovod's: ``source`` is this worker's own (see the module docstring)."""
        self._hvd_sgp_local.add(id(source))

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False):
        grads = tf.nest.flatten(super().gradient(target, sources, output_gradients,
                                                 unconnected_gradients))
        variables = tf.nest.flatten(sources)
        shared = gossip.shared_indices(variables, self._hvd_sgp_local)
        state = gossip.for_variables([variables[i] for i in shared], self._hvd_sgp)
        reduced = state.reduce_gradients([grads[i] for i in shared])
        state.communicate()
        return tf.nest.pack_sequence_as(
            sources, gossip.combine(grads, shared, reduced, self._hvd_sgp_scale_local))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """Horovod's: ([(local source, gradient)], [(shared source, gradient)])."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        local = [(s, g) for s, g in zip(sources, grads) if id(s) in self._hvd_sgp_local]
        shared = [(s, g) for s, g in zip(sources, grads) if id(s) not in self._hvd_sgp_local]
        return local, shared


_CLASSES: dict[type, type] = {}


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression=Compression.none,
                            sparse_as_dense: bool = False, op=Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups=None, process_set=global_process_set,
                            scale_local_gradients: bool = True, **sgp) -> tf.GradientTape:
    """Wrap a recorded tape; horovod.tensorflow's arguments plus SGP's keywords (below; see
    the module docstring for the update it makes).

    The sources passed to ``gradient()`` must be variables (they are mixed in place); the
    gossip state belongs to that list of variables, so the first tape's SGP options stand.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise SgpValueError("gradient_predivide_factor not supported with op != Average")
    check_groups(num_groups, groups)
    settings = adapter.settings(op, compression, with_keras_outer(sgp),
                                gradient_predivide_factor, tensors=compression_module.TENSORS, process_set=process_set)
    cls = type(gradtape)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_DistributedTapeMixin, cls), {})
    tape = object.__new__(_CLASSES[cls])
    tape.__dict__.update(gradtape.__dict__)  # the same recording, now distributed
    tape._hvd_sgp = settings
    tape._hvd_sgp_local = set()
    tape._hvd_sgp_scale_local = scale_local_gradients
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression=Compression.none,
                                   sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients: bool = True,
                                   **sgp) -> tf.GradientTape:
    """Horovod's: DistributedGradientTape with the trainable weights of ``local_layers`` (a
    layer or a list of layers) registered as local sources."""
    local_variables = local_layer_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, **sgp)
    for variable in local_variables:
        tape.register_local_source(variable)
    return tape


DistributedGradientTape.__doc__ += "\n    SGP keywords:\n" + keyword_help()
