"""A TF2 custom training loop (GradientTape in a ``tf.function``) on scikit-learn's digits,
written as a Horovod script: the only change from its Horovod form is the import line.

    mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 python examples/tensorflow2_digits.py --epochs 12
    TF_USE_LEGACY_KERAS=1 mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 -x TF_USE_LEGACY_KERAS \
        python examples/tensorflow2_digits.py

The second runs it on tf_keras (legacy Keras 2), as old Horovod scripts run on TF 2.16+.
"""
import argparse

import tensorflow as tf

import digits_data  # scikit-learn's digits, split once and cached
import hvd_sgp.tensorflow as hvd  # was: import horovod.tensorflow as hvd


def load_data(rank: int, size: int):
    """The train split sharded by rank; every rank keeps the whole test split."""
    x_train, x_test, y_train, y_test = digits_data.split(0.25, seed=0, stratify=True)
    return x_train[rank::size], y_train[rank::size], x_test, y_test


def main(epochs: int = 12, lr: float = 0.02, batch_size: int = 32, seed: int = 0,
         checkpoint_dir: str = "", verbose: int = 1):
    hvd.init()
    # Every rank draws its own initialisation; the broadcast after the first step makes them one.
    tf.keras.utils.set_random_seed(seed + hvd.rank())
    x_train, y_train, x_test, y_test = load_data(hvd.rank(), hvd.size())
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat()
               .shuffle(1000, seed=seed + hvd.rank()).batch(batch_size))
    model = tf.keras.Sequential([tf.keras.Input((64,)),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(lr * hvd.size(), momentum=0.9)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast after the first step, once the optimizer's variables exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    steps = epochs * len(x_train) // batch_size
    for batch, (images, labels) in enumerate(dataset.take(steps)):
        loss_value = training_step(images, labels, batch == 0)
        if verbose and batch % 50 == 0 and hvd.rank() == 0:
            print(f"step {batch}: loss {float(loss_value):.4f}")
    if hvd.rank() == 0 and checkpoint_dir:
        tf.train.Checkpoint(model=model, optimizer=opt).save(checkpoint_dir + "/ckpt")
    logits = model(x_test, training=False)
    accuracy = float(tf.reduce_mean(tf.cast(tf.argmax(logits, 1) == y_test, tf.float32)))
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f}")
    return model, opt, accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default="")
    args = parser.parse_args()
    main(args.epochs, args.lr, args.batch_size, checkpoint_dir=args.checkpoint_dir)
