"""hvd_sgp: Horovod's API, trained with Stochastic Gradient Push instead of AllReduce.

Use a framework package as you would Horovod's: ``import hvd_sgp.torch as hvd``,
``import hvd_sgp.tensorflow as hvd`` or ``import hvd_sgp.tensorflow.keras as hvd``.
"""
from hvd_sgp.version import __version__

__all__ = ["__version__"]
