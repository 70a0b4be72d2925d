"""hvd_sgp: Horovod's API, trained with Stochastic Gradient Push instead of AllReduce.

Use a framework package as you would Horovod's: ``import hvd_sgp.torch as hvd``,
``import hvd_sgp.tensorflow as hvd`` or ``import hvd_sgp.tensorflow.keras as hvd``.
``hvd_sgp.DistributedOptimizer`` serves scripts that keep Horovod for everything else.
"""
from hvd_sgp.version import __version__

__all__ = ["__version__", "DistributedOptimizer"]


def _framework(optimizer) -> str:
    """'torch' or 'keras', from the optimizer's class hierarchy (imports no framework)."""
    modules = [cls.__module__ for cls in type(optimizer).__mro__]
    if any(m == "torch" or m.startswith("torch.") for m in modules):
        return "torch"
    if any(m.split(".")[0] in ("keras", "tf_keras", "tensorflow") for m in modules):
        return "keras"
    raise TypeError(f"hvd_sgp.DistributedOptimizer wraps a torch.optim.Optimizer or a Keras "
                    f"optimizer, got {type(optimizer).__name__}")


def DistributedOptimizer(optimizer, *args, **kwargs):
    """Wrap a torch or Keras optimizer for SGP, importing only that framework.

    Starts hvd_sgp's runtime if needed, on the MPI world already running (Horovod's, say), so
    a script that keeps ``import horovod.torch as hvd`` can swap only its optimizer.
    """
    from hvd_sgp.common import runtime

    framework = _framework(optimizer)
    runtime.init()
    if framework == "torch":
        from hvd_sgp.torch import DistributedOptimizer as wrap
    else:
        from hvd_sgp.tensorflow.keras import DistributedOptimizer as wrap
    return wrap(optimizer, *args, **kwargs)
