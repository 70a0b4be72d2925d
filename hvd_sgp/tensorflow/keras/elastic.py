"""``hvd.elastic`` for Keras, as horovod.tensorflow.keras.elastic: ``run``, ``KerasState`` and
the callbacks that keep ``state.batch`` / ``state.epoch`` current and commit inside
``model.fit``, so a fit interrupted by a lost rank resumes where its last commit left it."""
from __future__ import annotations

from typing import Any

from hvd_sgp.tensorflow.elastic import ObjectState, TensorFlowKerasState, run
from hvd_sgp.tensorflow.flavour import keras


class KerasState(TensorFlowKerasState):
    """The state of a compiled Keras model (and its optimizer) plus any plain keywords."""

    def __init__(self, model, optimizer=None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a sync

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch; a resumed epoch runs only the batches
    that are left."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of finished epochs, counted across resets."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["run", "ObjectState", "KerasState", "TensorFlowKerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]
