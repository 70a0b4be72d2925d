"""horovod.tensorflow.keras.callbacks, plus ConsensusCallback for SGP.

Under SGP the ranks' models differ slightly while training; ``ConsensusCallback`` replaces them
by their exact average where one model is wanted: before evaluation, before a checkpoint, at
the end of training. Running statistics that SGP does not gossip (BatchNorm's moving mean and
variance: the model's non-trainable floating-point variables) are averaged exactly there too,
and by ``BestModelCheckpoint`` before it saves. The callbacks subclass the process's Keras
(Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import tensorflow as tf

from hvd_sgp.common import runtime
from hvd_sgp.common.horovod_api import collectives
from hvd_sgp.common.errors import SgpValueError
from hvd_sgp.tensorflow import flavour, gossip
from hvd_sgp.tensorflow.flavour import keras
from hvd_sgp.tensorflow.mpi_ops import broadcast_variables


def _value(tensor) -> float:
    return float(np.asarray(tf.convert_to_tensor(tensor)))


def _distributed(model):
    """The model's hvd.DistributedOptimizer (also inside a LossScaleOptimizer), or None."""
    optimizer = getattr(model, "optimizer", None)
    if not hasattr(optimizer, "average_parameters"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer if hasattr(optimizer, "average_parameters") else None


def sgp_optimizer(model, needed_by: str):
    """The model's hvd.DistributedOptimizer; a clear error if it has none."""
    optimizer = _distributed(model)
    if optimizer is None:
        raise SgpValueError(f"{needed_by} needs a model compiled with hvd.DistributedOptimizer")
    return optimizer


def _on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one allreduce)."""
    value = np.array([1 if flag else 0], dtype=np.int32)
    return bool(collectives.allreduce(value, collectives.ReduceOp.Min)[0])


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank root's model and optimizer variables before the first step (or, if the
    optimizer is built lazily, right after it), so all ranks start from one initialisation.
    As every Horovod Keras script has it, it also tells an SGP optimizer the epoch, for
    epoch-based schedules (HVD_SGP_SCHEDULE)."""

    def __init__(self, root_rank: int, device: str = "", local_variables=None):
        """``local_variables`` (Horovod's): a variable or a list of them not to broadcast."""
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif hasattr(local_variables, "assign"):
            local_variables = [local_variables]
        elif not all(hasattr(v, "assign") for v in local_variables):
            raise SgpValueError("All local variables must be of tf.Variable type.")
        self.local_variables = {id(v) for v in local_variables}

    def _shared(self, variables) -> list:
        return [v for v in variables if id(v) not in self.local_variables]

    def _broadcast(self) -> None:
        broadcast_variables(self._shared(self.model.variables), self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and flavour.built(optimizer):
            broadcast_variables(flavour.optimizer_variables(optimizer), self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None) -> None:
        """Before the first step where every rank's optimizer is built; else after it. The
        ranks agree (one allreduce). Where only some are (rank 0 resuming from
        hvd.load_model), the others build theirs here, so that root's saved step count
        reaches every rank before the first step, where SGP's iteration starts from it."""
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        built = optimizer is None or flavour.built(optimizer)
        if _on_every_rank(built):
            self._broadcast()
        elif not _on_every_rank(not built):  # (two more allreduces, once, when resuming)
            if not built:
                built = flavour.build(optimizer, self.model)
            if _on_every_rank(built):
                self._broadcast()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        optimizer = _distributed(self.model)
        if optimizer is not None:
            optimizer.set_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every numeric epoch log (loss, metrics, validation) exactly over all ranks.
    Put it before callbacks that read the logs."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        for key, value in zip(keys, collectives.allreduce(values)):
            logs[key] = float(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set lr = initial_lr * multiplier(epoch) for start_epoch <= epoch < end_epoch, per epoch
    (staircase) or per batch with a fractional epoch.

    ``momentum_correction`` is accepted and has no effect: Keras compiles the momentum into the
    train step as a constant.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _active(self) -> bool:
        return self.start_epoch <= self.current_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch)

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise SgpValueError("a per-batch learning rate schedule needs steps_per_epoch "
                                "(Keras could not tell it)")
        return steps

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if not self._active():
            return
        if self.staircase:
            if batch == 0:
                self._set(self.current_epoch)
        else:
            self._set(self.current_epoch + batch / self._steps())

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up from initial_lr / size to initial_lr over warmup_epochs (the
    large-batch recipe; ``initial_lr`` is the already-scaled rate, e.g. lr * hvd.size())."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        n = runtime.size()

        def multiplier(epoch: float) -> float:
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction,
                         steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.rank() == 0:
            lr = _value(self.model.optimizer.learning_rate)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: keep the best model (or its weights, ``save_weights_only``) by ``monitor``
    in ``filepath``, written by rank 0 only (by default best_model.keras, or
    best_model.weights.h5 for weights). Each time it checks, every rank first averages the
    running statistics (BatchNorm's) exactly. Put MetricAverageCallback and
    ConsensusCallback(every_epochs=1) before it so the choice and the weights saved are the
    network's."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: Union[str, int] = "epoch", filepath: Optional[str] = None):
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)

    def _save_model(self, epoch, batch, logs) -> None:
        gossip.average_statistics(self.model, _local_ids(self.model))
        if runtime.rank() == 0:
            super()._save_model(epoch, batch, logs)


def _local_ids(model) -> set:
    """Ids of the variables registered local with the model's DistributedOptimizer."""
    return set(getattr(_distributed(model), "_hvd_sgp_local", ()))


class ConsensusCallback(keras.callbacks.Callback):
    """Exact average of the parameters over all ranks (GossipEngine.average_parameters):
    before each evaluation (``model.evaluate`` and fit's validation), at the end of every
    ``every_epochs`` epochs (put it before a checkpoint callback), and at the end of training;
    the running statistics (BatchNorm's) with them. Needs a model compiled with
    hvd.DistributedOptimizer."""

    def __init__(self, before_evaluation: bool = True, every_epochs: int = 0,
                 at_train_end: bool = True):
        super().__init__()
        self.before_evaluation = before_evaluation
        self.every_epochs = every_epochs
        self.at_train_end = at_train_end

    def _average(self) -> None:
        sgp_optimizer(self.model, "ConsensusCallback").average_parameters(self.model)

    def on_test_begin(self, logs=None) -> None:
        if self.before_evaluation:
            self._average()

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self.every_epochs and (epoch + 1) % self.every_epochs == 0:
            self._average()

    def on_train_end(self, logs=None) -> None:
        if self.at_train_end:
            self._average()


class SgpMetricsCallback(keras.callbacks.Callback):
    """Adds SGP's figures to each epoch's ``logs`` (so History, TensorBoard and CSVLogger see
    them): the PushSum weight, seconds waited on peers and bytes sent, all local; with
    ``consensus=True`` also the deviation from the network mean, the consensus distance and
    the elastic-consistency estimate (one allreduce per epoch, every rank)."""

    def __init__(self, consensus: bool = False):
        super().__init__()
        self.consensus = consensus

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is None:
            return
        optimizer = sgp_optimizer(self.model, "SgpMetricsCallback")
        logs.update(optimizer.sgp_scalars(self.consensus))


class SgpTensorBoardCallback(keras.callbacks.Callback):
    """Every rank's SGP figures as TensorBoard scalars, written by rank 0 to ``log_dir`` with
    tf.summary: ``sgp_weight/rank<r>``, ``sgp_wait_seconds/rank<r>``,
    ``sgp_bytes_sent/rank<r>`` and, with ``consensus=True``, ``sgp_deviation/rank<r>``,
    ``sgp_elastic/rank<r>`` and ``sgp_distance``. At the end of each epoch (step = epoch), or
    every ``update_freq`` batches (step = batches trained). Every rank needs it in its
    callbacks: the figures are gathered (and the consensus measured) collectively."""

    def __init__(self, log_dir: str, update_freq: Union[str, int] = "epoch",
                 consensus: bool = True):
        super().__init__()
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise SgpValueError(f"update_freq must be 'epoch' or a positive number of batches, "
                                f"got {update_freq!r} on rank {runtime.rank()}")
        self.log_dir, self.update_freq, self.consensus = log_dir, update_freq, consensus
        self._writer = None
        self._batches = 0

    def _write(self, step: int) -> None:
        figures = sgp_optimizer(self.model, "SgpTensorBoardCallback").gathered_sgp_scalars(
            self.consensus)
        if runtime.rank() != 0:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default():
            for name, value in figures.items():
                tf.summary.scalar(name, value, step=step)
        self._writer.flush()

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._batches += 1
        if self.update_freq != "epoch" and self._batches % self.update_freq == 0:
            self._write(self._batches)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if self.update_freq == "epoch":
            self._write(epoch)

    def on_train_end(self, logs=None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
