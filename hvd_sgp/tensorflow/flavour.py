"""Which Keras: Keras 3, or tf_keras (legacy Keras 2, how Horovod Keras scripts run on TF 2.16+
under ``TF_USE_LEGACY_KERAS=1``).

The process's Keras is what ``tf.keras`` resolves to, as Horovod's ``from tensorflow import
keras``: callbacks and layers subclass its classes, ``load_model`` uses its loader. Optimizers
are told apart by their own class, so either Keras' optimizer is wrapped whatever ``tf.keras``
is. The three optimizer APIs differ where SGP hooks in: Keras 3 applies through ``apply``,
tf_keras' optimizers through ``apply_gradients`` (new ones aggregate in
``aggregate_gradients``, legacy ``OptimizerV2`` ones in ``_aggregate_gradients``).
"""
from __future__ import annotations

import sys

import tensorflow as tf

from hvd_sgp.common.errors import SgpValueError

keras = tf.keras
LEGACY: bool = keras.__name__.startswith("tf_keras")

KERAS3, TF_KERAS, TF_KERAS_LEGACY = "keras", "tf_keras", "tf_keras legacy"


def _loaded(name: str):
    """A Keras package if this process imported it (its objects exist only then), else None."""
    return sys.modules.get(name)


def family(optimizer) -> str:
    """KERAS3, TF_KERAS or TF_KERAS_LEGACY; anything else is refused as Horovod refuses it."""
    keras3, legacy_keras = _loaded("keras"), _loaded("tf_keras")
    if keras3 is not None and isinstance(optimizer, keras3.optimizers.Optimizer):
        return KERAS3
    if legacy_keras is not None:
        if isinstance(optimizer, legacy_keras.optimizers.Optimizer):
            return TF_KERAS
        if isinstance(optimizer, legacy_keras.optimizers.legacy.Optimizer):
            return TF_KERAS_LEGACY
    raise SgpValueError(f"DistributedOptimizer wraps Keras optimizers (tf.keras.optimizers.*, "
                        f"Keras 3 or tf_keras), got {type(optimizer).__name__}")


def is_loss_scale(optimizer) -> bool:
    """A LossScaleOptimizer of either Keras."""
    keras3, legacy_keras = _loaded("keras"), _loaded("tf_keras")
    if keras3 is not None and isinstance(optimizer, keras3.mixed_precision.LossScaleOptimizer):
        return True
    return legacy_keras is not None and isinstance(
        optimizer, legacy_keras.mixed_precision.LossScaleOptimizer)


def optimizer_variables(optimizer) -> list:
    """The optimizer's variables (a property in Keras 3 and new tf_keras, a method in legacy)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def built(optimizer) -> bool:
    """Whether the optimizer has created its variables (slots) yet."""
    if hasattr(optimizer, "built"):
        return bool(optimizer.built)
    if hasattr(optimizer, "_built"):
        return bool(optimizer._built)
    return len(optimizer_variables(optimizer)) > 1  # legacy: more than its iteration count


def build(optimizer, model) -> bool:
    """Create the optimizer's variables for ``model`` as its first step would (Keras 3 and
    new tf_keras optimizers); False where it cannot (a model not built yet, a legacy
    optimizer, which creates them only in its first step)."""
    variables = list(model.trainable_variables) if getattr(model, "built", False) else []
    if not variables or not hasattr(optimizer, "build"):
        return False
    optimizer.build(variables)
    return built(optimizer)


def is_layer(value) -> bool:
    """A Keras layer of either Keras."""
    return any(package is not None and isinstance(value, package.layers.Layer)
               for package in (_loaded("keras"), _loaded("tf_keras")))
