"""Overlap SGP on real MPI processes: conservation with mass in flight, bounded delay without
deadlock, the de-bias ablation; schedules and OSGP training through the PyTorch backend."""
import re

import pytest

from mpi_launch import run_mpi


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_overlap_core(n):
    out = run_mpi(n, "overlap_checks.py", "2000", "1,2", timeout=900).stdout
    assert f"all overlap checks passed on {n} ranks" in out
    assert "tau=1" in out and "tau=2" in out and "pushes in place" in out


def test_in_place_push_matches_copy():
    """Overlap SGP tau = 1's push reads the buffer in place; it must carry what the copying
    push carried (commit 6cc85ba summed arrivals in before it: the network average then moved
    at about half the learning rate). tau = 2 copies either way."""
    out = run_mpi(4, "overlap_checks.py", "0", "1,2", "check_in_place_push_matches_copy",
                  timeout=300).stdout
    assert "tau=1: pushes in place take the copying path's steps" in out, out
    assert "tau=2: pushes in_place ignored (copies) take" in out, out


def final_accuracy(out):
    return float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))


def test_osgp_digits_matches_sgp():
    sgp = final_accuracy(run_mpi(4, "../examples/pytorch_digits.py", timeout=600).stdout)
    osgp = final_accuracy(run_mpi(4, "../examples/pytorch_digits.py", timeout=600,
                                  env={"HVD_SGP_OVERLAP": "1", "HVD_SGP_MAX_DELAY": "1"}).stdout)
    print(f"SGP {sgp:.4f}, OSGP {osgp:.4f}")
    assert osgp >= sgp - 0.01, (osgp, sgp)
