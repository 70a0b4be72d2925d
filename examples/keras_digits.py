"""Keras ``model.fit`` on scikit-learn's digits, written as a Horovod script: the only change
from its Horovod form is the import line.

    mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 python examples/keras_digits.py --epochs 12
    mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 -x TF_USE_LEGACY_KERAS=1 python examples/keras_digits.py

The second runs it on tf_keras (legacy Keras 2), as old Horovod scripts run on TF 2.16+.
"""
import argparse
import os

import tensorflow as tf

import digits_data  # scikit-learn's digits, split once and cached
import hvd_sgp.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd


def load_data(rank: int, size: int):
    """The train split sharded by rank; every rank keeps the whole test split."""
    x_train, x_test, y_train, y_test = digits_data.split(0.25, seed=0, stratify=True)
    return x_train[rank::size], y_train[rank::size], x_test, y_test


def build_model() -> tf.keras.Model:
    return tf.keras.Sequential([tf.keras.Input((64,)),
                                tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(10)])


def main(epochs: int = 12, lr: float = 0.02, batch_size: int = 32, warmup_epochs: int = 2,
         seed: int = 0, checkpoint_dir: str = "", verbose: int = 1):
    hvd.init()
    # Every rank draws its own initialisation; the broadcast callback makes them one.
    tf.keras.utils.set_random_seed(seed + hvd.rank())
    x_train, y_train, x_test, y_test = load_data(hvd.rank(), hvd.size())
    model = build_model()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr * hvd.size(),
                                                 warmup_epochs=warmup_epochs, verbose=verbose),
    ]
    if hvd.rank() == 0 and checkpoint_dir:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(checkpoint_dir, "checkpoint-{epoch}.keras")))
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
              validation_data=(x_test, y_test), verbose=verbose if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f}")
    return model, accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default="")
    args = parser.parse_args()
    main(args.epochs, args.lr, args.batch_size, checkpoint_dir=args.checkpoint_dir)
