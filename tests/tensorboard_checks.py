"""SGP's figures into TensorBoard event files, from torch (log_sgp_metrics beside rank 0's
SummaryWriter) and from Keras (SgpTensorBoardCallback); run by test_tensorboard.py, which
reads the files back. argv: torch|keras LOG_DIR."""
import sys

framework, log_dir = sys.argv[1], sys.argv[2]


def torch_run() -> None:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    import hvd_sgp.torch as hvd
    from hvd_sgp.torch.tensorboard import log_sgp_metrics

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())  # different models: the deviation is not zero
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    writer = SummaryWriter(log_dir) if hvd.rank() == 0 else None  # Horovod's recipe
    for step in range(1, 13):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        if step % 4 == 0:
            figures = log_sgp_metrics(writer, opt, step)
    if writer is not None:
        writer.close()
    assert figures[f"sgp_bytes_sent/rank{hvd.rank()}"] == opt.metrics()["bytes_sent"]
    print(f"rank {hvd.rank()}: torch figures written", flush=True)


def keras_run() -> None:
    import numpy as np
    import tensorflow as tf

    import hvd_sgp.tensorflow.keras as hvd

    hvd.init()
    tf.keras.utils.set_random_seed(hvd.rank())
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, "tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)), loss="mse")
    x = np.random.default_rng(hvd.rank()).normal(size=(64, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.SgpTensorBoardCallback(log_dir)])
    print(f"rank {hvd.rank()}: keras figures written", flush=True)


{"torch": torch_run, "keras": keras_run}[framework]()
