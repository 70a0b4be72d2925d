"""Keras resume as Horovod's keras_imagenet_resnet50.py does it; run by test_resume.py.
argv: PHASE DIR. PHASE ``first``: one epoch, rank 0 saves ``checkpoint-1.keras`` (Keras 3;
``.h5`` under tf_keras). PHASE ``resume``: rank 0 finds the checkpoint and broadcasts the epoch;
rank 0 loads it with hvd.load_model, the others build the model afresh; fit from
``initial_epoch`` with BroadcastGlobalVariablesCallback(0). PHASE ``full``: both epochs in one
fit, in DIR/full. Each phase writes rank 0's (optimizer step, SGP iteration, exchange) after
every batch to DIR/<phase>.json: the schedule (HVD_SGP_SCHEDULE, a switch at a step) must
advance in the resumed run as in the uninterrupted one."""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import hvd_sgp.tensorflow as tf_hvd
import hvd_sgp.tensorflow.keras as hvd
from hvd_sgp.tensorflow import flavour
from mpi_checks import Checks

keras = flavour.keras
phase, folder = sys.argv[1], sys.argv[2]
hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
me, n = hvd.rank(), hvd.size()
checks = Checks(f"keras resume {phase}", tf_hvd.rank, tf_hvd.size, tf_hvd.barrier,
                tf_hvd.allgather_object)
SUFFIX = "h5" if flavour.LEGACY else "keras"
CHECKPOINT = os.path.join(folder, "full" if phase == "full" else "",
                          "checkpoint-{epoch}." + SUFFIX)
BATCHES = 8  # per epoch and rank
if me == 0:
    os.makedirs(os.path.dirname(CHECKPOINT), exist_ok=True)

rng = np.random.default_rng(me)
x = rng.normal(size=(16 * BATCHES, 4)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)


def fresh_model():
    keras.utils.set_random_seed(100 + me)  # a different start on every rank: rank 0's wins
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    return model


def weights_agree(model) -> bool:
    mine = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return bool(np.allclose(mine, hvd.broadcast(mine, root_rank=0).numpy(), atol=1e-6))


class StepLog(keras.callbacks.Callback):
    """(optimizer step, SGP iteration, exchange) after every batch."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        metrics = self.model.optimizer.metrics()
        self.steps.append((int(self.model.optimizer.iterations.numpy()),
                           int(metrics["iteration"]), metrics["mode"]))


@checks
def check_keras_resume():
    resume_from_epoch = 0
    if phase == "resume" and me == 0:
        for epoch in range(2, 0, -1):
            if os.path.exists(CHECKPOINT.format(epoch=epoch)):
                resume_from_epoch = epoch
                break
    resume_from_epoch = int(hvd.broadcast(resume_from_epoch, 0, name="resume_from_epoch"))
    if resume_from_epoch > 0 and me == 0:
        model = hvd.load_model(CHECKPOINT.format(epoch=resume_from_epoch))
    else:
        model = fresh_model()
    log = StepLog()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), log]
    if me == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(CHECKPOINT))
    epochs = 1 if phase == "first" else 2
    resumed = 1 if phase == "resume" else 0
    history = model.fit(x, y, batch_size=16, epochs=epochs, initial_epoch=resume_from_epoch,
                        callbacks=callbacks, verbose=0)
    trained = len(history.history["loss"])
    iterations = int(model.optimizer.iterations.numpy())
    sgp = model.optimizer.sgp_state()
    model.optimizer.average_parameters()
    if me == 0:
        with open(os.path.join(folder, f"{phase}.json"), "w") as out:
            json.dump(log.steps, out)
    checks.verify(f"{phase}: resumed from epoch {resume_from_epoch}, trained {trained} "
                  f"epoch(s); optimizer at step {iterations}, SGP at iteration "
                  f"{sgp['iteration']}, loss {history.history['loss'][-1]:.3f}",
                  trained == epochs - resume_from_epoch and resume_from_epoch == resumed
                  and iterations == BATCHES * epochs and sgp["iteration"] == BATCHES * epochs
                  and np.isfinite(history.history["loss"][-1]) and weights_agree(model),
                  f"iterations {iterations} sgp {sgp}")


checks.run([])
