"""The TensorFlow / Keras backend on real MPI ranks (n = 1, 2, 4): collectives, broadcasts,
exact equivalence with AllReduce SGD on the complete graph, Keras fit and a tf.function
GradientTape loop on scikit-learn's digits, save / load_model, Horovod's signatures, local
variables, SyncBatchNormalization (also on 3 ranks), BatchNorm statistics, mixed precision;
the same checks again under tf_keras (legacy Keras 2, TF_USE_LEGACY_KERAS=1: the Keras is
chosen at import, so it is a launch of its own). See tensorflow_checks.py."""
import importlib.util

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

from mpi_launch import SharedChecks, run_mpi  # noqa: E402

KERAS_3 = SharedChecks("tensorflow_checks.py", worlds=[2])
TF_KERAS = SharedChecks("tensorflow_checks.py", worlds=[2], env={"TF_USE_LEGACY_KERAS": "1"},
                        needs="tf_keras")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_tensorflow_checks(n):
    out = KERAS_3.run(n, timeout=420)
    print(out)
    assert f"all tf checks passed on {n} ranks" in out
    assert "FAIL" not in out
    if n == 4:
        assert "2 ranks/node: gradients averaged exactly inside the node" in out


def test_sync_batch_norm_three_ranks():
    out = run_mpi(3, "tensorflow_checks.py", "check_sync_batch_norm", timeout=300).stdout
    print(out)
    assert "all tf checks passed on 3 ranks" in out
    assert "batches [4, 5, 6]" in out


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="tf_keras is not installed (pip install hvd_sgp[legacy-keras])")
def test_tensorflow_checks_tf_keras():
    out = TF_KERAS.run(2, timeout=480)
    print(out)
    assert "all tf checks passed on 2 ranks" in out
    assert "the Keras is tf.keras's (tf_keras" in out
    assert "load_model(legacy_opts=True) re-wraps the legacy optimizer" in out
