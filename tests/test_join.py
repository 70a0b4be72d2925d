"""hvd.join() with uneven data per rank (Horovod's answer to ranks with different numbers of
batches): exact data parallelism in one node, gossip across nodes, on 2, 3 and 4 ranks."""
import pytest

from mpi_launch import run_checks, run_mpi


@pytest.mark.parametrize("n,local_size", [(2, ""), (3, ""), (4, ""), (2, "1"), (3, "1"),
                                          (4, "1"), (4, "2")])
def test_join_with_uneven_data(n, local_size):
    if local_size == "1":  # single-rank nodes: the launch shared with other checks
        out = run_checks(n, "join_checks.py", timeout=600)
    else:  # "": the machine is one node
        out = run_mpi(n, "join_checks.py", env={"HVD_SGP_LOCAL_SIZE": local_size},
                      timeout=600).stdout
    assert f"all join checks passed on {n} ranks" in out
    print(out)
