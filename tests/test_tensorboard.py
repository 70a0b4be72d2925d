"""SGP's figures as TensorBoard scalars (per-rank deviation, PushSum weight, bytes sent, wait
time): the event files written on real MPI ranks hold them, read back with TensorBoard."""
import importlib.util

import numpy as np
import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                reason="tensorboard is not installed (pip install "
                                       "hvd_sgp[tensorboard])")

N = 3  # on 2 ranks each mix is an exact average and every deviation is 0
PER_RANK = ("sgp_weight", "sgp_wait_seconds", "sgp_bytes_sent", "sgp_deviation", "sgp_elastic")


def read_events(log_dir) -> dict:
    """tag -> [(step, value)] from every event file under log_dir (torch's add_scalar writes
    scalars, tf.summary writes tensors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    files = list(log_dir.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {log_dir}"
    found = {}
    for path in files:
        events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found[tag] = [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["tensors"]:
            found[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                          for e in events.Tensors(tag)]
    return found


def check_figures(found: dict, steps: list) -> None:
    expected = {f"{name}/rank{r}" for name in PER_RANK for r in range(N)} | {"sgp_distance"}
    assert expected <= set(found), sorted(found)
    for tag in expected:
        assert [step for step, _ in found[tag]] == steps, (tag, found[tag])
    for r in range(N):
        weights = [v for _, v in found[f"sgp_weight/rank{r}"]]
        assert np.allclose(weights, 1.0), weights  # the exponential graph: w stays 1
        sent = [v for _, v in found[f"sgp_bytes_sent/rank{r}"]]
        assert sent[0] > 0 and sent == sorted(sent) and sent[-1] > sent[0], sent
        assert all(v > 0 for _, v in found[f"sgp_deviation/rank{r}"])  # seeds differ
    # the distance is the root mean square of the ranks' deviations
    for i, (_, distance) in enumerate(found["sgp_distance"]):
        squares = [found[f"sgp_deviation/rank{r}"][i][1] ** 2 for r in range(N)]
        assert abs(distance - np.sqrt(np.mean(squares))) < 1e-5 * distance

def test_torch_summary_writer_holds_sgp_scalars(tmp_path):
    out = run_mpi(N, "tensorboard_checks.py", "torch", str(tmp_path), timeout=180).stdout
    assert out.count("torch figures written") == N
    check_figures(read_events(tmp_path), [4, 8, 12])


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tensorflow is not installed (pip install hvd_sgp[tensorflow])")
@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf_keras"])
def test_keras_callback_holds_sgp_scalars(tmp_path, legacy):
    if legacy == "1" and importlib.util.find_spec("tf_keras") is None:
        pytest.skip("tf_keras is not installed (pip install hvd_sgp[legacy-keras])")
    out = run_mpi(N, "tensorboard_checks.py", "keras", str(tmp_path), timeout=240,
                  env={"TF_USE_LEGACY_KERAS": legacy}).stdout
    assert out.count("keras figures written") == N
    check_figures(read_events(tmp_path), [0, 1, 2])
