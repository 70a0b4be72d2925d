"""The TensorFlow / Keras backend on real MPI ranks (n = 1, 2, 4): collectives, broadcasts,
exact equivalence with AllReduce SGD on the complete graph, Keras fit and a tf.function
GradientTape loop on scikit-learn's digits, save / load_model. See tensorflow_checks.py."""
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")

from mpi_launch import run_mpi  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 4])
def test_tensorflow_checks(n):
    out = run_mpi(n, "tensorflow_checks.py", timeout=420).stdout
    print(out)
    assert f"all tf checks passed on {n} ranks" in out
    assert "FAIL" not in out
    if n == 4:
        assert "2 ranks/node: gradients averaged exactly inside the node" in out
