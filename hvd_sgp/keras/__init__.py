"""``import hvd_sgp.keras as hvd``: the same as hvd_sgp.tensorflow.keras (as horovod.keras)."""
from hvd_sgp.tensorflow.keras import *  # noqa: F401,F403
from hvd_sgp.tensorflow.keras import __all__, callbacks  # noqa: F401
