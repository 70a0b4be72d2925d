"""The PushSum core on real MPI processes, sizes 1 to 8 (powers of two and not)."""
import pytest

from mpi_launch import run_mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_core_checks(n):
    out = run_mpi(n, "core_checks.py").stdout
    assert f"all core checks passed on {n} ranks" in out
    if n >= 3:
        assert "de-bias" in out
    if n in (2, 4, 8):
        assert "exact after log2(n)" in out
    if n in (3, 6):
        assert "falls geometrically" in out
    if n in (4, 8):
        assert "node-sharded" in out
