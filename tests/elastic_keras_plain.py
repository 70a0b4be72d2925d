"""A plain Keras script (no hvd.elastic.run) in fault-tolerant mode, every rank its own node,
where nothing is reduced, so the TF adapter never calls begin_step: rank 2 is SIGKILLed in
the middle of fit; the survivors repair inside the optimizer's step, realign, and the step
where they meet begins with the exact average (end_step begins it: the step protocol).
Run by test_elastic.py."""
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import hvd_sgp.tensorflow.keras as hvd
from hvd_sgp.common import runtime

hvd.init()
rng = np.random.default_rng(runtime.origin_rank())
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ np.ones((8, 1))).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))


class Kill(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if runtime.origin_rank() == 2 and batch == 6:
            print("rank 2 dies at batch 6", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0,
          callbacks=[Kill()])
repairs = model.optimizer._sgp_session().engine.repairs
assert repairs and repairs[0]["lost"] == [2], repairs
assert repairs[0].get("met_at") == repairs[0]["skipped_to"] > 0, repairs
print(f"rank {hvd.rank()} met at call {repairs[0]['met_at']} after the repair", flush=True)
if hvd.rank() == 0:
    print(f"plain keras survived on {hvd.size()} ranks", flush=True)
