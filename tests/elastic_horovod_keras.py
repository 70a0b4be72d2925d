"""Keras fit in the shape of Horovod's elastic Keras example (only the import line differs
from a Horovod script, plus --kill-rank): KerasState, the commit/batch/epoch callbacks,
elastic.run around fit, a reset callback that rescales the rate and, as Horovod's
tensorflow2_keras_mnist_elastic.py, takes one step to meet ranks that join (a replacement,
under sgprun --max-np, takes its first step before the training function, as that script's
ranks do). ``--kill-rank`` names the rank by its launch rank (a replacement has a new one).
"""
import argparse
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import hvd_sgp.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd
from hvd_sgp.common import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--sigkill", action="store_true", help="SIGKILL rather than os._exit(1)")
args = parser.parse_args()

hvd.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
scaled_lr = 0.01 * hvd.size()
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr)))
model.fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)  # builds the optimizer's state
launch_rank = runtime.origin_rank()


class Kill(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if launch_rank == args.kill_rank and state.epoch == 1 and batch == 5:
            print(f"rank {launch_rank} dies at epoch 1, batch 5", flush=True)
            if args.sigkill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)


state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    model.optimizer.learning_rate.assign(0.01 * hvd.size())
    model.fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)  # meets a new rank's first step


state.register_reset_callbacks([on_state_reset])
callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state), Kill()]


@hvd.elastic.run
def train(state):
    model.fit(dataset, steps_per_epoch=20, epochs=args.epochs - state.epoch,
              callbacks=callbacks, verbose=0)


train(state)
flat = tf.concat([tf.reshape(w, [-1]) for w in model.trainable_weights], 0)
everyone = hvd.allgather(tf.reshape(flat, [1, -1])).numpy()
spread = float(np.abs(everyone - everyone[0]).max())
launch_ranks = hvd.allgather(tf.constant([launch_rank])).numpy().tolist()
if hvd.rank() == 0:
    print(f"trained on {hvd.size()} ranks (launch ranks {launch_ranks}); "
          f"epoch state {state.epoch}; models differ by at most {spread:.2g}", flush=True)
