"""outer_optimizer= given a Keras optimizer, on real MPI processes; run by test_outer.py.

A Keras SGD(momentum, nesterov) as the outer optimizer (an instance, and a factory) gives the
parameters the numpy preset nesterov:LR:MU gives, step by step, over exact AllReduce and over
PushSum gossip; a Keras Adam trains; the Keras optimizer's state resumes exactly; a factory
that returns no optimizer fails naming the rank. Keras 3, or tf_keras under
TF_USE_LEGACY_KERAS=1.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hvd_sgp.tensorflow as hvd  # noqa: E402
from hvd_sgp.common.errors import SgpValueError  # noqa: E402
from hvd_sgp.tensorflow import flavour  # noqa: E402
from mpi_checks import Checks, expect_error  # noqa: E402

keras = flavour.keras
hvd.init()
n, me = hvd.size(), hvd.rank()
checks = Checks("keras outer", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
H, LR, MU = 4, 0.5, 0.8
W = np.array([[0.5], [-1.0], [0.25], [1.5]], dtype=np.float32)


def model_of() -> "keras.Model":
    keras.utils.set_random_seed(7)  # one start on every rank
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    return model


def flat(model) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


def run(steps: int, outer, mode: str = "sgp", model=None, opt=None, seed: int = 0):
    """Train ``steps`` custom-loop steps; the parameters after each step."""
    model = model or model_of()
    opt = opt or hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1),
                                          mode=mode, local_steps=H, outer_optimizer=outer)
    rng = np.random.default_rng(100 * seed + me)
    trace = []
    for _ in range(steps):
        x = (rng.normal(size=(16, 4)) + 0.3 * me).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - x @ W) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        trace.append(flat(model))
    return model, opt, np.array(trace)


def keras_nesterov():
    return keras.optimizers.SGD(learning_rate=LR, momentum=MU, nesterov=True)


@checks
def check_keras_sgd_is_the_nesterov_preset():
    diffs = {}
    for mode in ("allreduce", "sgp"):
        _, _, preset = run(4 * H, f"nesterov:{LR}:{MU}", mode)
        kinds = [("instance", keras_nesterov()), ("factory", keras_nesterov)]
        if flavour.LEGACY:  # tf_keras' OptimizerV2 too
            kinds.append(("legacy", keras.optimizers.legacy.SGD(LR, momentum=MU, nesterov=True)))
        for label, outer in kinds:
            _, opt, made = run(4 * H, outer, mode)
            diffs[f"{mode} {label}"] = float(np.abs(made - preset).max())
            taken = opt._sgp_session().engine.outer.step.optimizer.iterations.numpy()
            assert taken == 3, taken  # Keras took the outer steps (the first sync records)
        _, _, plain = run(4 * H, None, mode)
        moved = float(np.abs(plain - preset).max())
        assert moved > 1e-2, moved  # the outer step changes the trajectory
    assert max(diffs.values()) < 1e-5, diffs
    return (f"{flavour.family(keras_nesterov())} SGD(momentum={MU}, nesterov) == "
            f"nesterov:{LR}:{MU}, every step of {4 * H} (largest difference {diffs})")


@checks
def check_keras_adam_trains_and_resumes():
    model, opt, trace = run(6 * H, lambda: keras.optimizers.Adam(0.05))
    step = opt._sgp_session().engine.outer.step
    state = step.state()
    assert len(state["keras"]) >= 3, state  # iterations and Adam's two moments
    start, end = np.abs(trace[0]).sum(), np.abs(trace[-1]).sum()
    assert np.isfinite(trace).all() and start != end
    # a checkpoint of the outer state, taken and loaded back, continues the same way
    saved_outer = opt._sgp_session().engine.outer.state()
    weights = model.get_weights()
    _, _, ahead = run(2 * H, None, model=model, opt=opt, seed=1)
    model.set_weights(weights)
    opt._sgp_session().engine.outer.load_state(saved_outer)
    _, _, again = run(2 * H, None, model=model, opt=opt, seed=1)
    diff = float(np.abs(ahead - again).max())
    assert diff < 1e-6, diff
    return (f"a Keras Adam outer optimizer trains; its state reloaded gives the same steps "
            f"({diff:.1e})")


@checks
def check_bad_factory():
    model = model_of()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1), local_steps=1,
                                   outer_optimizer=lambda: "not an optimizer")
    x = np.ones((2, 4), np.float32)

    def one_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    one_step()  # the first sync records the anchor
    expect_error(SgpValueError, one_step, rank=me)
    return "a factory that returns no Keras optimizer: an error naming the rank"


checks.run()
