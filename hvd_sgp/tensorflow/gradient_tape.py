"""DistributedGradientTape: SGP for custom training loops that call ``tape.gradient``.

A tape has no optimizer step after which to gossip, so it mixes when the gradients are taken:
``gradient()`` computes the gradients at the current variables z_k, averages them exactly in
the node, then replaces the variables by their PushSum-mixed values and returns the gradients
for the user's ``apply_gradients``. The update is z_{k+1} = mix(z_k) - lr * g(z_k), the
"combine, then adapt with the pre-mix gradient" form of decentralised SGD (as D-PSGD): the
gradient and the exchange could overlap, and at consensus it is the same fixed point as SGP.
"""
from __future__ import annotations

import tensorflow as tf

from hvd_sgp.common import adapter
from hvd_sgp.common.options import keyword_help
from hvd_sgp.tensorflow import gossip
from hvd_sgp.tensorflow.compression import Compression
from hvd_sgp.tensorflow.mpi_ops import Average, check_process_set, global_process_set


class _DistributedTapeMixin:
    _hvd_sgp: adapter.Settings

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        variables = tf.nest.flatten(sources)
        state = gossip.for_variables(variables, self._hvd_sgp)
        reduced = state.reduce_gradients(tf.nest.flatten(grads))
        state.communicate()
        return tf.nest.pack_sequence_as(sources, reduced)


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
    check_process_set(process_set)
    settings = adapter.settings(op, compression, sgp, gradient_predivide_factor)
    cls = type(gradtape)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_DistributedTapeMixin, cls), {})
    tape = object.__new__(_CLASSES[cls])
    tape.__dict__.update(gradtape.__dict__)  # the same recording, now distributed
    tape._hvd_sgp = settings
    return tape


DistributedGradientTape.__doc__ += "\n    SGP keywords:\n" + keyword_help()
