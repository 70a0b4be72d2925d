"""Checks of the Horovod-API collectives through hvd_sgp.tensorflow (the same negotiated core
as torch's): process sets, errors on every rank, gradients, scaling, join. Eager and inside
tf.function. Run by test_horovod_api.py; prints "ok <name>" on rank 0.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# one thread each, as the other TensorFlow checks set it: scripts sharing a launch
# (mpi_launch.SharedChecks) must agree, TensorFlow fixes them at its first op
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hvd_sgp.tensorflow as hvd  # noqa: E402
import hvd_sgp.tensorflow.keras as hvdk  # noqa: E402

hvd.init()
n, me = hvd.size(), hvd.rank()


def ok(name):
    hvd.barrier()
    if me == 0:
        print(f"ok {name}", flush=True)


def both(fn):
    """fn's results eagerly and inside a tf.function."""
    return [fn(), tf.function(fn)()]


def check_process_sets():
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    even = hvd.add_process_set(evens)
    odd = hvd.add_process_set(odds)
    mine, ranks = (even, evens) if me % 2 == 0 else (odd, odds)

    def run():
        x = tf.constant([float(me)])
        return (hvd.allreduce(x, op=hvd.Sum, process_set=mine),
                hvd.allgather(x, process_set=mine),
                hvd.broadcast(x, ranks[-1], process_set=mine),
                hvd.reducescatter(tf.ones([2 * len(ranks), 1]), op=hvd.Sum, process_set=mine),
                hvd.alltoall(tf.range(len(ranks), dtype=tf.float32), process_set=mine)[1])
    for total, gathered, root, rows, counts in both(run):
        assert total.numpy().tolist() == [sum(ranks)]
        assert gathered.numpy().tolist() == ranks
        assert root.numpy().tolist() == [ranks[-1]]
        assert rows.numpy().tolist() == [[len(ranks)]] * 2
        assert counts.numpy().tolist() == [1] * len(ranks)
    assert hvd.allgather_object(me, process_set=mine) == ranks
    assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)
    ok("process sets on TF collectives (eager and tf.function)")


def check_errors():
    if n == 1:
        return
    try:
        hvd.allreduce(tf.ones([2 + me]))
    except hvd.HorovodInternalError as e:
        assert "shape" in str(e) and "rank 1" in str(e), e
    else:
        raise AssertionError("no error for different shapes")
    try:
        tf.function(lambda: hvd.allgather(tf.ones([1, 1 + me])))()
    except Exception as e:  # noqa: BLE001  (inside a graph TF re-raises it as its own error)
        assert "beyond the first dimension" in str(e), e
    else:
        raise AssertionError("no error for different trailing shapes in tf.function")
    try:
        hvd.alltoall(tf.ones([n + 1]))
    except ValueError as e:
        assert "divide" in str(e), e
    ok("mismatches raise on every rank (eager HorovodInternalError, in graphs TF's error)")


def check_gradients():
    def grads():
        x = tf.ones([2, 3])
        rows = tf.ones([me + 1, 2])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, rows])
            total = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
            mean = tf.reduce_sum(hvd.allreduce(x))
            gathered = hvd.allgather(rows)
            weighted = tf.reduce_sum(gathered * tf.range(tf.shape(gathered)[0],
                                                         dtype=tf.float32)[:, None])
            root = tf.reduce_sum(hvd.broadcast(x, n - 1))
            scattered = tf.reduce_sum(hvd.reducescatter(tf.ones([2 * n, 3]) * x[0, 0],
                                                        op=hvd.Sum))
        return (tape.gradient(total, x), tape.gradient(mean, x), tape.gradient(weighted, rows),
                tape.gradient(root, x), tape.gradient(scattered, x))
    first = sum(range(1, me + 1))
    for total, mean, gathered, root, scattered in both(grads):
        assert np.all(total.numpy() == n) and np.all(mean.numpy() == 1)
        assert gathered.numpy()[:, 0].tolist() == list(range(first, first + me + 1))
        assert np.all(root.numpy() == (1.0 if me == n - 1 else 0.0))
        assert scattered.numpy()[0, 0] == 6 * n * n  # allgather of n * ones(2, 3), all ranks
    w = tf.range(n, dtype=tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(w)
        out, _ = hvd.alltoall(w * (me + 1), tf.ones([n], tf.int32))
        loss = tf.reduce_sum(out * tf.range(n, dtype=tf.float32))
    assert tape.gradient(loss, w).numpy().tolist() == [float(me * (me + 1))] * n
    ok("gradients of allreduce, allgather, broadcast, reducescatter (eager and tf.function) "
       "and alltoall")


def check_scaling_and_keras():
    out = hvd.reducescatter(tf.fill([n, 2], 3), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=2.0)
    assert out.dtype == tf.int32 and out.numpy().tolist() == [[2 * n] * 2]  # int(1.5) = 1
    assert float(hvdk.allreduce(np.float32(me)).numpy()) == (n - 1) / 2
    assert hvdk.reducescatter(np.ones((n, 1), np.float32), op=hvd.Sum).numpy().tolist() == [[n]]
    assert issubclass(hvdk.HorovodInternalError, RuntimeError)
    assert hvd.HostsUpdatedInterrupt(False).skip_sync is False
    ok("reducescatter pre/postscale on integers; Keras collectives return tf tensors")


def check_join():
    for s in range(me):
        out = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name=f"tf.step.{s}")
        assert out.numpy().tolist() == [n - 1 - s], out
    assert hvd.join() == n - 1
    ok("join with TF allreduces")


for check in (check_process_sets, check_errors, check_gradients, check_scaling_and_keras,
              check_join):
    check()
if me == 0:
    print(f"all horovod api tf checks passed on {n} ranks", flush=True)
