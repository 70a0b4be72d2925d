"""hvd_sgp.torch on real MPI processes: Horovod's behaviours, SGP's properties, convergence."""
import re

import pytest

from mpi_launch import SharedChecks, run_mpi


TORCH = SharedChecks("torch_checks.py", worlds=[1, 2, 3, 4])
# HVD_SGP_LOCAL_SIZE=2 on 4 ranks: two nodes of two ranks, each rank carrying half
TWO_RANK_NODES = SharedChecks(
    "torch_checks.py", "check_complete_equals_allreduce", "check_state_dict_and_consensus",
    "check_regression", "check_placements", "check_node_groups_in_a_user_world",
    "check_mixed_precision", "check_sparse_gradients", "check_process_set_optimizer",
    "check_zero_grad_keeps_views_same_trajectory", worlds=[4], local_size="2")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_torch_checks(n):
    out = TORCH.run(n, timeout=600)
    assert f"all torch checks passed on {n} ranks" in out
    if n in (2, 4, 8):
        assert "exact average in log2(n)" in out


def test_two_rank_nodes_average_inside_and_gossip_across():
    """HVD_SGP_LOCAL_SIZE=2 on 4 ranks: two nodes of two ranks, each rank carrying half (the
    zero_grad check here covers the in-node exact average; test_torch_checks, single-rank
    nodes)."""
    out = TWO_RANK_NODES.run(4)
    assert "all torch checks passed on 4 ranks" in out
    assert "ok zero_grad keeps the gradient views" in out


def digits(n, mode):
    out = run_mpi(n, "../examples/pytorch_digits.py", env={"HVD_SGP_MODE": mode},
                  timeout=600).stdout
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    deviation = float(re.search(r"max relative deviation from the network average ([0-9.]+)",
                                out).group(1))
    return accuracy, deviation


@pytest.mark.parametrize("n", [4, 8])
def test_digits_sgp_matches_allreduce(n):
    sgp_acc, sgp_dev = digits(n, "sgp")
    ar_acc, _ = digits(n, "allreduce")
    print(f"n={n}: SGP accuracy {sgp_acc:.4f}, AllReduce {ar_acc:.4f}, deviation {sgp_dev:.4f}")
    assert sgp_acc >= ar_acc - 0.015, (sgp_acc, ar_acc)
    assert sgp_dev < 0.05, sgp_dev
    assert sgp_acc > 0.9


def test_synthetic_benchmark_runs_in_both_modes():
    for flag in ([], ["--allreduce"]):
        out = run_mpi(2, "../examples/pytorch_synthetic_benchmark.py", "--num-iters", "1",
                      "--num-batches-per-iter", "1", "--num-warmup-batches", "1",
                      "--depth", "1", "--width", "8", *flag).stdout
        assert "Total img/sec on 2 ranks" in out
        assert ("AllReduce" if flag else "SGP") in out
