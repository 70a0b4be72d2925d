"""TensorFlow / Keras backend checks on real MPI ranks: many checks per launch.

    mpirun -np N -x HVD_SGP_LOCAL_SIZE=1 python tests/tensorflow_checks.py
    mpirun -np N -x HVD_SGP_LOCAL_SIZE=1 -x TF_USE_LEGACY_KERAS=1 python tests/tensorflow_checks.py

Prints one line per check (rank 0) and "all tf checks passed on N ranks"; exits non-zero on
the first failure. With N=4 it also re-initialises with two ranks per node to check the exact
in-node gradient averaging. The Keras is tf.keras's, chosen at import: Keras 3, or tf_keras
(legacy Keras 2) under TF_USE_LEGACY_KERAS=1, where the same checks run on tf_keras' models
and optimizers (new and legacy).
"""
import functools
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import keras_digits  # noqa: E402
import tensorflow2_digits  # noqa: E402

import hvd_sgp.keras as hvd_keras_alias  # noqa: E402
import hvd_sgp.tensorflow as hvd  # noqa: E402
import hvd_sgp.tensorflow.keras as hvdk  # noqa: E402
from hvd_sgp.common import runtime  # noqa: E402
from hvd_sgp.common.errors import OptionError, SgpValueError  # noqa: E402
from hvd_sgp.tensorflow import flavour  # noqa: E402
from mpi_checks import Checks, expect_error  # noqa: E402

EPOCHS = 12
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
hvd.init()
checks = Checks("tf", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)


def same_on_all_ranks(arrays, tol: float = 0.0) -> bool:
    flat = np.concatenate([np.ravel(np.asarray(a, dtype=np.float64)) for a in arrays])
    everyone = hvd.allgather_object(flat)
    return all(np.allclose(e, everyone[0], rtol=0, atol=tol) for e in everyone)


def raises(fn, kind=SgpValueError, text: str = "") -> bool:
    try:
        fn()
    except kind as error:
        return text in str(error)
    return False


@checks
def check_api() -> None:
    names = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
             "cross_size", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
             "gloo_enabled", "gloo_built", "nccl_built", "cuda_built", "rocm_built",
             "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
             "reducescatter", "broadcast_variables", "broadcast_object", "allgather_object",
             "join", "barrier", "Average", "Sum", "Min", "Max", "Product", "Adasum",
             "Compression", "DistributedOptimizer", "DistributedGradientTape"]
    names += ["PartialDistributedGradientTape", "SyncBatchNormalization"]
    keras_names = ["DistributedOptimizer", "load_model", "broadcast_global_variables",
                   "allreduce", "allgather", "broadcast", "callbacks", "Compression",
                   "PartialDistributedOptimizer", "SyncBatchNormalization"]
    missing = [n for n in names if not hasattr(hvd, n)] + \
        [n for n in keras_names if not hasattr(hvdk, n) or not hasattr(hvd_keras_alias, n)]
    checks.verify("API names of hvd_sgp.tensorflow / .tensorflow.keras / .keras", not missing,
                 str(missing) if missing else "")
    checks.verify("basics", hvd.size() == runtime.size() and hvd.mpi_enabled()
                  and not hvd.gloo_built()
                 and hvd.cross_size() == hvd.size() and hvd.local_size() == 1)
    checks.verify(f"the Keras is tf.keras's ({tf.keras.__name__})", flavour.LEGACY == LEGACY
                  and tf.keras.__name__.startswith("tf_keras") == LEGACY)


# Horovod 0.28.1's parameter order (the leading names of each signature).
HOROVOD_SIGNATURES = {
    "keras DistributedOptimizer": (hvdk.DistributedOptimizer, [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "backward_passes_per_step",
        "average_aggregated_gradients", "num_groups", "groups", "process_set",
        "scale_local_gradients"]),
    "keras PartialDistributedOptimizer": (hvdk.PartialDistributedOptimizer, [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "groups", "process_set", "local_layers",
        "scale_local_gradients"]),
    "tensorflow DistributedOptimizer": (hvd.DistributedOptimizer, [
        "optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression",
        "sparse_as_dense", "backward_passes_per_step", "op", "gradient_predivide_factor",
        "average_aggregated_gradients", "num_groups", "groups", "process_set",
        "scale_local_gradients"]),
    "DistributedGradientTape": (hvd.DistributedGradientTape, [
        "gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
        "gradient_predivide_factor", "num_groups", "groups", "process_set",
        "scale_local_gradients"]),
    "PartialDistributedGradientTape": (hvd.PartialDistributedGradientTape, [
        "gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
        "gradient_predivide_factor", "num_groups", "groups", "process_set", "local_layers",
        "scale_local_gradients"]),
    "load_model": (hvdk.load_model, [
        "filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"]),
    "BestModelCheckpoint": (hvdk.callbacks.BestModelCheckpoint, [
        "monitor", "verbose", "save_weights_only", "mode", "save_freq"]),
    "BroadcastGlobalVariablesCallback": (hvdk.callbacks.BroadcastGlobalVariablesCallback, [
        "root_rank", "device", "local_variables"]),
}


@checks
def check_horovod_signatures() -> None:
    wrong = []
    for label, (fn, names) in HOROVOD_SIGNATURES.items():
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
        if params[:len(names)] != names:
            wrong.append((label, params))
    checks.verify("Horovod 0.28.1's parameter names and positional order", not wrong,
                  str(wrong) if wrong else "")
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), None, "/cpu:0", "/cpu:0",
                                    hvd.Compression.none, False, 1.0, hvd.Sum)
    tape = hvd.DistributedGradientTape(tf.GradientTape(), "/cpu:0", "", hvd.Compression.none)
    checks.verify("device_dense / device_sparse are accepted positionally",
                  opt._hvd_sgp.sum_gradients and hasattr(tape, "register_local_source"))
    expect_error(SgpValueError, lambda: hvdk.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), groups=-1), rank=hvd.rank())
    expect_error(SgpValueError, lambda: hvd.DistributedGradientTape(
        tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0), rank=hvd.rank())
    expect_error(SgpValueError, lambda: hvdk.PartialDistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), local_layers=[object()]), rank=hvd.rank())
    expect_error(SgpValueError, lambda: hvdk.SyncBatchNormalization(fused=True),
                 rank=hvd.rank())
    checks.ok("Horovod's ValueErrors: groups, predivide with op=Sum, local_layers, fused=True")


def collective_results(n: int, r: int):
    """Every collective once; run eagerly and inside tf.function."""
    x = tf.fill([3], tf.cast(r + 1, tf.float32))
    out = {op: hvd.allreduce(x, op=getattr(hvd, op)) for op in
           ("Average", "Sum", "Min", "Max", "Product")}
    out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16)
    out["sum_average_false"] = hvd.allreduce(x, average=False)
    out["grouped"] = hvd.grouped_allreduce([x, tf.cast(x, tf.float64) * 2])
    out["allgather"] = hvd.allgather(tf.fill([r + 1, 2], float(r)))
    out["broadcast"] = hvd.broadcast(x, root_rank=n - 1)
    rows = tf.constant([[10.0 * r + j] for j in range(n)])
    out["alltoall"] = hvd.alltoall(rows, splits=tf.ones([n], tf.int32))
    out["reducescatter"] = hvd.reducescatter(tf.ones([2 * n, 2]) * float(r + 1))
    return out


@checks
def check_collectives() -> None:
    n, r = hvd.size(), hvd.rank()
    for how, fn in (("eager", collective_results), ("tf.function", tf.function(
            lambda: collective_results(n, r)))):
        out = fn(n, r) if how == "eager" else fn()
        product = float(np.prod(np.arange(1, n + 1)))
        expect = {"Average": (n + 1) / 2, "Sum": n * (n + 1) / 2, "Min": 1.0, "Max": float(n),
                  "Product": product, "fp16": (n + 1) / 2, "sum_average_false": n * (n + 1) / 2}
        ok = all(np.allclose(out[k].numpy(), v) for k, v in expect.items())
        checks.verify(f"allreduce Average/Sum/Min/Max/Product/fp16 ({how})", ok)
        g32, g64 = out["grouped"]
        checks.verify(f"grouped_allreduce keeps dtypes ({how})", g64.dtype == tf.float64 and
                     np.allclose(g32, (n + 1) / 2) and np.allclose(g64, n + 1))
        gathered = out["allgather"].numpy()
        want = np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)])
        checks.verify(f"allgather with different first dims ({how})",
                     gathered.shape == want.shape and np.array_equal(gathered, want))
        checks.verify(f"broadcast from the last rank ({how})", np.allclose(out["broadcast"], n))
        received, counts = out["alltoall"]
        checks.verify(f"alltoall with splits ({how})",
                     np.array_equal(received.numpy()[:, 0], [10.0 * q + r for q in range(n)])
                     and np.array_equal(counts.numpy(), np.ones(n)))
        scattered = out["reducescatter"].numpy()
        checks.verify(f"reducescatter ({how})", scattered.shape == (2, 2)
                     and np.allclose(scattered, (n + 1) / 2))
    checks.verify("Adasum is refused with a clear error",
                  raises(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum), SgpValueError,
                         "Adasum"))
    checks.verify("broadcast_object / allgather_object / join / barrier",
                 hvd.broadcast_object({"a": r}, root_rank=0) == {"a": 0}
                 and hvd.allgather_object(r) == list(range(n)) and 0 <= hvd.join() < n
                 and hvd.barrier() is None)
    checks.verify("keras allreduce/allgather/broadcast/reducescatter return tf tensors, as "
                  "Horovod's",
                  np.allclose(hvdk.allreduce(np.float32(r)).numpy(), (n - 1) / 2)
                  and hvdk.allgather(np.array([r])).numpy().tolist() == list(range(n))
                  and float(hvdk.broadcast(np.float32(r), 0).numpy()) == 0.0
                  and hvdk.reducescatter(np.ones((n, 2), np.float32) * r).numpy().tolist()
                  == [[(n - 1) / 2] * 2])


def small_model(seed: int, width: int = 16) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(width, "tanh"),
                                tf.keras.layers.Dense(3)])


def rank_batch(r: int, step: int = 0):
    rng = np.random.default_rng(1000 * r + step)
    return (rng.normal(size=(16, 8)).astype("float32"),
            rng.integers(0, 3, size=16).astype("int64"))


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@checks
def check_broadcast_variables() -> None:
    r = hvd.rank()
    for how in ("eager", "tf.function"):
        model = small_model(seed=r)
        opt = tf.keras.optimizers.Adam(0.01)
        x, y = rank_batch(r)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        differ = not same_on_all_ranks([v.numpy() for v in model.variables]) or hvd.size() == 1

        def broadcast_all():
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        (broadcast_all() if how == "eager" else tf.function(broadcast_all)())
        slots = [v.numpy() for v in opt.variables]
        checks.verify(f"broadcast_variables of model variables and Adam slots ({how})",
                     differ and same_on_all_ranks([v.numpy() for v in model.variables])
                     and same_on_all_ranks(slots) and len(slots) > 3)


@checks
def check_metric_average() -> None:
    n, r = hvd.size(), hvd.rank()
    logs = {"loss": float(r), "accuracy": 0.5 + r / 10, "val_loss": 3.0 * r}
    hvdk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    mean = (n - 1) / 2
    checks.verify("MetricAverageCallback averages the logs exactly",
                 logs == {"loss": mean, "accuracy": 0.5 + mean / 10, "val_loss": 3.0 * mean})


@checks
def check_lr_schedules() -> None:
    n = hvd.size()
    model = small_model(0)
    model.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=LOSS)
    warm = hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.8, warmup_epochs=2)
    warm.set_model(model)
    warm.set_params({"steps": 10})
    seen = []
    for epoch in range(3):
        warm.on_epoch_begin(epoch)
        for batch in (0, 5):
            warm.on_train_batch_begin(batch)
            seen.append(float(model.optimizer.learning_rate.numpy()))
    want = [0.8 / n * (e * (n - 1) / 2 + 1) for e in (0, 0.5, 1, 1.5)]
    checks.verify("LearningRateWarmupCallback ramps lr / size to lr",
                 np.allclose(seen[:4], want) and seen[4] == seen[3] == seen[5], str(seen))
    sched = hvdk.callbacks.LearningRateScheduleCallback(0.5, lambda e: 0.1 ** e, start_epoch=1)
    sched.set_model(model)
    sched.on_epoch_begin(2)
    sched.on_train_batch_begin(0)
    checks.verify("LearningRateScheduleCallback (staircase)",
                 np.isclose(model.optimizer.learning_rate.numpy(), 0.005))


def exact_reference(steps: int, lr: float, momentum: float, passes: int = 1):
    """AllReduce SGD: gradients averaged exactly with hvd.allreduce, plain Keras SGD step
    (accumulating ``passes`` summed micro-batch gradients per update)."""
    r = hvd.rank()
    model = small_model(seed=7)
    accumulate = {"gradient_accumulation_steps": passes} if passes > 1 else {}
    opt = tf.keras.optimizers.SGD(lr, momentum=momentum, **accumulate)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        grads = hvd.grouped_allreduce(tape.gradient(loss, model.trainable_variables))
        opt.apply_gradients(zip([g * passes for g in grads], model.trainable_variables))

    for k in range(steps):
        step(*rank_batch(r, k))
    return [v.numpy() for v in model.trainable_variables]


def sgp_custom_loop(steps: int, lr: float, momentum: float, use_tape: bool,
                    compiled: bool = True, passes: int = 1, legacy_optimizer: bool = False,
                    **sgp):
    r = hvd.rank()
    model = small_model(seed=7)
    kind = tf.keras.optimizers.legacy.SGD if legacy_optimizer else tf.keras.optimizers.SGD
    if use_tape:
        opt = kind(lr, momentum=momentum)
    else:
        opt = hvd.DistributedOptimizer(kind(lr, momentum=momentum),
                                       backward_passes_per_step=passes, **sgp)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        if use_tape:
            tape = hvd.DistributedGradientTape(tape, **sgp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(step) if compiled else step
    for k in range(steps):
        step(*rank_batch(r, k))
    return [v.numpy() for v in model.trainable_variables], opt


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def exact_equivalence(label: str = "", full: bool = True) -> None:
    reference = exact_reference(6, 0.1, 0.9)
    for compiled in ((True, False) if full else (True,)):
        params, opt = sgp_custom_loop(6, 0.1, 0.9, use_tape=False, compiled=compiled,
                                      topology="complete")
        diff = max_diff(params, reference)
        checks.verify(f"{label}topology='complete' SGP == exact gradient averaging (custom loop, "
                      f"{'tf.function' if compiled else 'eager'})", diff < 1e-5,
                      f"max |diff| {diff:.2e}")
    checks.verify(f"{label}DistributedOptimizer is a subclass of the user's optimizer class",
                 isinstance(opt, tf.keras.optimizers.SGD) and type(opt).__name__ == "SGD"
                 and hasattr(opt, "average_parameters"))
    if not full:
        return
    params, _ = sgp_custom_loop(6, 0.1, 0.9, use_tape=True, mode="allreduce")
    diff = max_diff(params, reference)
    checks.verify(f"{label}DistributedGradientTape mode='allreduce' == exact averaging",
                 diff < 1e-5, f"max |diff| {diff:.2e}")
    if LEGACY:
        params, opt = sgp_custom_loop(6, 0.1, 0.9, use_tape=False, topology="complete",
                                      legacy_optimizer=True)
        diff = max_diff(params, reference)
        checks.verify(f"{label}tf_keras legacy optimizer (OptimizerV2): complete SGP == exact",
                      diff < 1e-5 and isinstance(opt, tf.keras.optimizers.legacy.SGD),
                      f"max |diff| {diff:.2e}")
        expect_error(SgpValueError, lambda: hvd.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1), backward_passes_per_step=2), rank=hvd.rank())
        return
    params, _ = sgp_custom_loop(6, 0.1, 0.9, use_tape=False, passes=2, topology="complete")
    diff = max_diff(params, exact_reference(6, 0.1, 0.9, passes=2))
    checks.verify(f"{label}backward_passes_per_step=2 (summed, one exchange per update) == exact",
                 diff < 1e-5, f"max |diff| {diff:.2e}")


@checks
def check_exact_equivalence() -> None:
    exact_equivalence()


class HalfCompressor:
    """A script's own compressor in Horovod's interface (not one of hvd.Compression's)."""

    @staticmethod
    def compress(tensor):
        return tf.cast(tensor, tf.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx)


@checks
def check_custom_compressor() -> None:
    custom, _ = sgp_custom_loop(4, 0.1, 0.9, use_tape=False, compression=HalfCompressor)
    fp16, _ = sgp_custom_loop(4, 0.1, 0.9, use_tape=False, compression=hvd.Compression.fp16)
    diff = max_diff(custom, fp16)
    checks.verify("a script's own Horovod Compressor gossips as the fp16 wire does",
                  diff == 0.0, f"max |diff| {diff:.2e}")


@checks
def check_options() -> None:
    os.environ["HVD_SGP_TOPOLOGY"] = "no-such-graph"
    try:
        from_env = raises(lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                          OptionError)
    finally:
        del os.environ["HVD_SGP_TOPOLOGY"]
    checks.verify("HVD_SGP_* environment variables are read (a bad topology is named)", from_env)
    log = os.path.join(tempfile.gettempdir(), f"hvd_sgp_tf_metrics_{os.getpid()}.jsonl")
    log = hvd.broadcast_object(log, root_rank=0)
    os.environ.update(HVD_SGP_METRICS=log, HVD_SGP_METRICS_EVERY="1")
    try:
        params, opt = sgp_custom_loop(6, 0.1, 0.9, use_tape=False,
                                      schedule="0:sgp,3s:allreduce")
    finally:
        del os.environ["HVD_SGP_METRICS"], os.environ["HVD_SGP_METRICS_EVERY"]
    checks.verify("schedule '0:sgp,3s:allreduce' with momentum: the switch averages the models and "
                 "the optimizer's slots, then they stay one",
                 same_on_all_ranks(params, 1e-6) and opt.metrics()["mode"] == "allreduce")
    first = None
    if hvd.rank() == 0:  # rank 0 writes the log
        first = json.loads(open(log).readline())
        os.remove(log)
    first = hvd.broadcast_object(first, root_rank=0)
    checks.verify("the metrics log gets the learning rate (elastic estimate = deviation / lr)",
                 all(abs(e - d / 0.1) < 1e-6 * max(1.0, e)
                     for e, d in zip(first["elastic"], first["deviation"])))
    checks.verify("op=Adasum and non-Keras optimizers are refused",
                  raises(lambda: hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                           op=hvd.Adasum),
                        SgpValueError, "Adasum")
                 and raises(lambda: hvd.DistributedOptimizer(object()), SgpValueError, "Keras"))


@functools.cache
def reference_accuracy() -> float:
    """Single-process training on the whole train split (rank 0 trains, all ranks get it)."""
    accuracy = None
    if hvd.rank() == 0:
        tf.keras.utils.set_random_seed(0)
        x_train, y_train, x_test, y_test = keras_digits.load_data(0, 1)
        model = keras_digits.build_model()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.02, momentum=0.9),
                      loss=LOSS, metrics=["accuracy"])
        model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS, verbose=0)
        accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    return hvd.broadcast_object(accuracy, 0)


def verify_accuracies(label: str, mine: float, reference: float) -> None:
    everyone = np.array(hvd.allgather_object(mine))
    mean = float(everyone.mean())
    checks.verify(f"{label}: network mean test accuracy within 2 points of single-process",
                 abs(mean - reference) <= 0.02, f"mean {mean:.4f} vs {reference:.4f}")
    worst = float(np.max(np.abs(everyone - mean) / mean))
    checks.verify(f"{label}: every rank within 5% of the network mean", worst <= 0.05,
                 f"ranks {np.round(everyone, 4).tolist()}")


def evaluate(model, x, y) -> float:
    logits = model(x, training=False)
    return float(np.mean(np.argmax(logits.numpy(), 1) == y))


@checks
def check_keras_fit() -> None:
    reference = reference_accuracy()
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, 0)
    model, _ = keras_digits.main(epochs=EPOCHS, checkpoint_dir=directory, verbose=0)
    _, _, x_test, y_test = keras_digits.load_data(0, 1)
    opt = model.optimizer
    steps = EPOCHS * -(-len(keras_digits.load_data(hvd.rank(), hvd.size())[0]) // 32)
    metrics = opt.metrics()
    checks.verify("keras fit: gossip ran in compiled train steps (not run_eagerly)",
                 not model.run_eagerly and metrics["iteration"] == steps
                 and (metrics["bytes_sent"] > 0 or hvd.size() == 1),
                 f"{metrics['iteration']} exchanges, {metrics['bytes_sent']} bytes sent")
    verify_accuracies("keras fit + 3 callbacks", evaluate(model, x_test, y_test), reference)
    opt.average_parameters()
    consensus = evaluate(model, x_test, y_test)
    checks.verify("keras fit: consensus model (average_parameters) within 2 points",
                 same_on_all_ranks([v.numpy() for v in model.trainable_variables])
                 and abs(consensus - reference) <= 0.02, f"{consensus:.4f}")
    if hvd.rank() == 0:
        written = sorted(os.listdir(directory))
    checks.verify("keras fit: rank 0 wrote the checkpoints",
                 hvd.rank() != 0 or len(written) == EPOCHS)
    save_load(model, directory)


@checks
def check_fit_variants() -> None:
    """Keras fit with several steps per compiled call and under LossScaleOptimizer: the
    exchange runs at every step (complete graph: all equal one plain fit, step for step)."""
    x, y, _, _ = keras_digits.load_data(hvd.rank(), hvd.size())
    x, y = x[:96], y[:96]
    results = {}
    for label, steps_per_execution, loss_scale in (("plain", 1, False),
                                                   ("steps_per_execution=3", 3, False),
                                                   ("LossScaleOptimizer", 1, True)):
        tf.keras.utils.set_random_seed(0)
        model = keras_digits.build_model()
        base = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        if loss_scale:
            base = tf.keras.mixed_precision.LossScaleOptimizer(base)
        opt = hvdk.DistributedOptimizer(base, topology="complete")
        model.compile(optimizer=opt, steps_per_execution=steps_per_execution,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        results[label] = ([v.numpy() for v in model.trainable_variables],
                          opt.metrics()["iteration"])
    params, iterations = results.pop("plain")
    for label, (other, other_iterations) in results.items():
        diff = max_diff(other, params)
        checks.verify(f"keras fit with {label}: gossip at every step, same as plain fit",
                     other_iterations == iterations == 6 and diff < 1e-5, f"max |diff| {diff:.1e}")


class _SpyInitialState(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [v.numpy() for v in self.model.trainable_variables]


def save_load(model, directory: str) -> None:
    path = os.path.join(directory, "saved.keras")
    if hvd.rank() == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvdk.load_model(path)
    opt = loaded.optimizer
    checks.verify("load_model re-wraps the saved optimizer (its class, its state)",
                 isinstance(opt, tf.keras.optimizers.SGD) and hasattr(opt, "average_parameters")
                 and int(opt.iterations.numpy()) == int(model.optimizer.iterations.numpy())
                 and max_diff([v.numpy() for v in loaded.variables],
                              [v.numpy() for v in model.variables]) == 0.0)
    # Continue training from different states: the broadcast must make them one again.
    for v in loaded.trainable_variables:
        v.assign(v + 0.01 * hvd.rank())
    spy = _SpyInitialState()
    x_train, y_train, x_test, y_test = keras_digits.load_data(hvd.rank(), hvd.size())
    best = os.path.join(directory, "best.keras")
    history = loaded.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0,
                         validation_data=(x_test, y_test),
                         callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0), spy,
                                    hvdk.callbacks.MetricAverageCallback(),
                                    hvdk.callbacks.SgpMetricsCallback(consensus=True),
                                    hvdk.callbacks.ConsensusCallback(every_epochs=1),
                                    hvdk.callbacks.BestModelCheckpoint(filepath=best)])
    logged = history.history
    checks.verify("SgpMetricsCallback puts weight, waits, bytes and consensus figures in the logs",
                 {"sgp_weight", "sgp_bytes_sent", "sgp_deviation", "sgp_distance", "sgp_elastic"}
                 <= set(logged) and (hvd.size() == 1 or logged["sgp_bytes_sent"][-1] > 0))
    checks.verify("BestModelCheckpoint: rank 0 saved the best model", hvd.rank() != 0
                 or os.path.exists(best))
    checks.verify("BroadcastGlobalVariablesCallback makes different states one before training",
                 same_on_all_ranks(spy.weights))
    checks.verify("loaded model trains with gossip; ConsensusCallback leaves one model",
                 opt.metrics()["iteration"] > 0
                 and same_on_all_ranks([v.numpy() for v in loaded.trainable_variables])
                 and evaluate(loaded, x_test, y_test) > 0.9)


@checks
def check_tape_loop() -> None:
    reference = reference_accuracy()
    model, opt, accuracy = tensorflow2_digits.main(epochs=EPOCHS, verbose=0)
    verify_accuracies("tf.function GradientTape loop", accuracy, reference)


@checks
def check_xla_refused() -> None:
    model = small_model(0)
    model.compile(optimizer=hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                  loss=LOSS, jit_compile=True)
    x, y = rank_batch(hvd.rank())
    checks.verify("XLA (jit_compile=True) is refused with a clear error",
                 raises(lambda: model.fit(x, y, verbose=0), SgpValueError, "jit_compile=False"))


def local_reference(steps: int, lr: float, local_layer_index: int):
    """Horovod's local variables, by hand: shared gradients averaged exactly, the local
    layer's gradients divided by size (scale_local_gradients), plain SGD."""
    n, r = hvd.size(), hvd.rank()
    model = small_model(seed=7)
    local = {id(v) for v in model.layers[local_layer_index].trainable_weights}
    opt = tf.keras.optimizers.SGD(lr)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        averaged = hvd.grouped_allreduce(grads)
        grads = [g / n if id(v) in local else a for g, a, v in zip(grads, averaged, variables)]
        opt.apply_gradients(zip(grads, variables))

    for k in range(steps):
        step(*rank_batch(r, k))
    return model


def local_sgp(steps: int, lr: float, use_tape: bool):
    r = hvd.rank()
    model = small_model(seed=7)
    head = model.layers[-1]
    if use_tape:
        opt = tf.keras.optimizers.SGD(lr)
    else:
        opt = hvdk.PartialDistributedOptimizer(tf.keras.optimizers.SGD(lr), local_layers=head,
                                               topology="complete")

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        if use_tape:
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=[head],
                                                      mode="allreduce")
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    for k in range(steps):
        step(*rank_batch(r, k))
    return model, opt


@checks
def check_local_variables() -> None:
    """register_local_var / local_layers: the local layer is neither averaged nor gossiped
    (its gradient only scaled by 1/size); the rest is SGP (the optimizer on the complete graph,
    the tape in mode='allreduce': both exact)."""
    reference = local_reference(4, 0.1, -1)
    wrapped = None
    for use_tape in (False, True):
        model, opt = local_sgp(4, 0.1, use_tape)
        wrapped = wrapped or opt
        label = "PartialDistributedGradientTape" if use_tape else "PartialDistributedOptimizer"
        shared = [v.numpy() for v in model.layers[0].trainable_weights]
        local = [v.numpy() for v in model.layers[-1].trainable_weights]
        diff = max_diff(shared + local, [v.numpy() for v in reference.layers[0].trainable_weights]
                        + [v.numpy() for v in reference.layers[-1].trainable_weights])
        checks.verify(f"{label}: shared layers as Horovod's average, the local layer stays this "
                      "rank's (gradient / size)", diff < 1e-5 and same_on_all_ranks(shared, 1e-6)
                      and (hvd.size() == 1 or not same_on_all_ranks(local)),
                      f"max |diff| {diff:.1e}")
    expect_error(SgpValueError, lambda: wrapped.register_local_var(model.layers[0].kernel),
                 rank=hvd.rank())
    checks.ok("register_local_var after the first step is refused")


@checks
def check_sync_batch_norm() -> None:
    """SyncBatchNormalization on each rank's slice (slices of different sizes) == one
    BatchNormalization on the concatenated batch: outputs, moving statistics, the input
    gradient of the summed loss and (summed over ranks) the gamma/beta gradients."""
    n, r = hvd.size(), hvd.rank()
    sizes = [4 + q for q in range(n)]
    rng = np.random.default_rng(5)
    full = rng.normal(2.0, 3.0, size=(sum(sizes), 6)).astype("float32")
    weights = rng.normal(size=(sum(sizes), 6)).astype("float32")
    mine = slice(sum(sizes[:r]), sum(sizes[:r + 1]))

    def run(layer, x, w):
        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * w)
        gx, gg, gb = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, gx, gg, gb

    for how in ("eager", "tf.function"):
        sync = hvdk.SyncBatchNormalization(momentum=0.5)
        plain = tf.keras.layers.BatchNormalization(momentum=0.5)
        step = run if how == "eager" else tf.function(run)
        y, gx, gg, gb = step(sync, full[mine], weights[mine])
        py, pgx, pgg, pgb = run(plain, full, weights)
        summed = hvd.grouped_allreduce([gg, gb], op=hvd.Sum)
        diffs = [np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in (
            (y, py[mine]), (gx, pgx[mine]), (summed[0], pgg), (summed[1], pgb),
            (sync.moving_mean, plain.moving_mean), (sync.moving_variance, plain.moving_variance))]
        checks.verify(f"SyncBatchNormalization == BatchNormalization on the global batch "
                      f"({how}, batches {sizes})", max(diffs) < 1e-4,
                      "max |diff| output, dx, dgamma, dbeta, moving mean, moving variance: "
                      + ", ".join(f"{d:.1e}" for d in diffs))


def bn_model(seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16),
                                tf.keras.layers.BatchNormalization(),
                                tf.keras.layers.Activation("tanh"), tf.keras.layers.Dense(3)])


def moving_statistics(model) -> list:
    return [v.numpy() for v in model.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating]


@checks
def check_batchnorm_statistics() -> None:
    """BatchNorm's moving statistics are not gossiped; average_parameters(model),
    ConsensusCallback and BestModelCheckpoint average them exactly."""
    r = hvd.rank()
    model = bn_model(7)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05))
    model.compile(optimizer=opt, loss=LOSS)
    x, y = rank_batch(r)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = moving_statistics(model)
    mean = [np.mean(a, axis=0) for a in zip(*hvd.allgather_object(before))]
    opt.average_parameters(model)
    after = moving_statistics(model)
    checks.verify("average_parameters(model): moving mean/variance = exact mean over ranks",
                  (hvd.size() == 1 or not same_on_all_ranks(before)) and same_on_all_ranks(after)
                  and max_diff(after, mean) < 1e-6 and len(after) == 2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvdk.callbacks.ConsensusCallback()])
    checks.verify("ConsensusCallback leaves one model, statistics included",
                  same_on_all_ranks([v.numpy() for v in model.variables]))
    directory = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None, 0)
    path = os.path.join(directory, "best.weights.h5")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y),
              callbacks=[hvdk.callbacks.MetricAverageCallback(),
                         hvdk.callbacks.BestModelCheckpoint(save_weights_only=True,
                                                            filepath=path)])
    checks.verify("BestModelCheckpoint(save_weights_only=True): statistics averaged, rank 0 "
                  "wrote the weights", same_on_all_ranks(moving_statistics(model))
                  and (r != 0 or os.path.exists(path)))


def loss_scale(opt) -> float:
    """The dynamic loss scale of either Keras' LossScaleOptimizer."""
    value = opt.loss_scale if LEGACY else opt.dynamic_scale
    return float(np.asarray(tf.convert_to_tensor(value)))


def mixed_fit(overflow_rank: int, wrap_loss_scale: bool):
    """Three steps under mixed_float16; ``overflow_rank``'s second batch overflows float16."""
    x, y, _, _ = keras_digits.load_data(hvd.rank(), hvd.size())
    x, y = x[:96].copy(), y[:96]
    if hvd.rank() == overflow_rank:
        x[32:64] *= 1e6
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(64, "relu"),
                                 tf.keras.layers.Dense(10, dtype="float32")])
    base = tf.keras.optimizers.SGD(0.05)
    if wrap_loss_scale:
        base = tf.keras.mixed_precision.LossScaleOptimizer(base)
    opt = hvdk.DistributedOptimizer(base)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    scaler = model.optimizer
    finite = all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    return loss_scale(scaler), finite, model


@checks
def check_mixed_precision() -> None:
    """LossScaleOptimizer under a mixed_float16 policy: one rank's overflow makes every rank
    skip that step and halve its scale, so the scale stays identical everywhere."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layouts = [("hvd.DistributedOptimizer(LossScaleOptimizer(SGD))", True)]
        if LEGACY:
            layouts.append(("compile's LossScaleOptimizer around hvd.DistributedOptimizer",
                            False))
        for label, wrap in layouts:
            clean, _, model = mixed_fit(-1, wrap)
            checks.verify(f"{label}: float16 compute, float32 variables",
                          model.layers[0].compute_dtype == "float16"
                          and all(v.dtype == "float32" for v in model.trainable_variables))
            scale, finite, _ = mixed_fit(hvd.size() - 1, wrap)
            scales = hvd.allgather_object(scale)
            checks.verify(f"{label}: an overflow on rank {hvd.size() - 1} halves every rank's "
                          "loss scale, parameters stay finite",
                          len(set(scales)) == 1 and scale == clean / 2 and finite,
                          f"scales {scales}, without the overflow {clean}")
        if not LEGACY:
            expect_error(SgpValueError, lambda: mixed_fit(-1, False), rank=hvd.rank())
            checks.ok("Keras 3: compile's LossScaleOptimizer around hvd.DistributedOptimizer "
                      "is refused with the fix")
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


@checks.when(LEGACY)
def check_legacy_optimizer_fit() -> None:
    """tf_keras' legacy optimizers: model.fit, an .h5 save and load_model(legacy_opts=True)."""
    x, y, x_test, y_test = keras_digits.load_data(hvd.rank(), hvd.size())
    tf.keras.utils.set_random_seed(hvd.rank())
    model = keras_digits.build_model()
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=4, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvdk.callbacks.ConsensusCallback()])
    checks.verify("legacy SGD: fit gossips every step and ends in one model",
                  opt.metrics()["iteration"] == 4 * -(-len(x) // 32)
                  and same_on_all_ranks([v.numpy() for v in model.variables])
                  and evaluate(model, x_test, y_test) > 0.85)
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, 0)
    path = os.path.join(directory, "legacy.h5")
    if hvd.rank() == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvdk.load_model(path, legacy_opts=True)
    checks.verify("load_model(legacy_opts=True) re-wraps the legacy optimizer",
                  isinstance(loaded.optimizer, tf.keras.optimizers.legacy.SGD)
                  and hasattr(loaded.optimizer, "average_parameters")
                  and max_diff([v.numpy() for v in loaded.variables],
                               [v.numpy() for v in model.variables]) == 0.0)
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
    checks.verify("the loaded model trains with gossip",
                  loaded.optimizer.metrics()["iteration"] > 0)


def bench_model(width: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(width, "relu"),
                                tf.keras.layers.Dense(width, "relu"), tf.keras.layers.Dense(10)])


def step_function(model, opt, x, y):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    step()
    return step


@checks.when(hvd.size() <= 2 and not LEGACY)  # 4 ranks time the machine, not the bridge
def check_bridge_cost() -> None:
    """Per-step time of a compiled train step: plain Keras SGD, the SGP optimizer in
    mode='allreduce' (the bridge without gossip, plus the gradient allreduce for n > 1) and
    with gossip. Best of 3 interleaved rounds (the machine is shared)."""
    x = np.random.default_rng(0).normal(size=(32, 64)).astype("float32")
    y = np.arange(32) % 10
    for width in (64, 512):
        steps = {"plain": step_function(bench_model(width), tf.keras.optimizers.SGD(0.01), x, y)}
        for mode in ("allreduce", "sgp"):
            opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), mode=mode)
            steps[mode] = step_function(bench_model(width), opt, x, y)
        best = {k: float("inf") for k in steps}
        for _ in range(3):
            for kind, step in steps.items():
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    step()
                best[kind] = min(best[kind], (time.perf_counter() - start) / 20)
        if hvd.rank() == 0:
            print(f"info step time, {bench_model(width).count_params()} parameters, "
                  f"{hvd.size()} ranks: plain {best['plain'] * 1e3:.2f} ms, "
                  f"mode=allreduce {best['allreduce'] * 1e3:.2f} ms, "
                  f"sgp {best['sgp'] * 1e3:.2f} ms", flush=True)


@checks.when(hvd.size() == 4)
def check_two_ranks_per_node() -> None:
    hvd.shutdown()
    os.environ["HVD_SGP_LOCAL_SIZE"] = "2"
    hvd.init()
    checks.verify("re-initialised with 2 ranks per node", hvd.local_size() == 2
                 and hvd.cross_size() == hvd.size() // 2)
    exact_equivalence("2 ranks/node: ", full=False)
    params, _ = sgp_custom_loop(4, 0.1, 0.9, use_tape=False)
    pair = hvd.allgather_object([p.copy() for p in params])[hvd.rank() ^ 1]
    checks.verify("2 ranks/node: gradients averaged exactly inside the node (node ranks identical)",
                 max_diff(params, pair) == 0.0)


checks.run()
