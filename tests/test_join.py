"""hvd.join() with uneven data per rank (Horovod's answer to ranks with different numbers of
batches): exact data parallelism in one node, gossip across nodes, on 2, 3 and 4 ranks."""
import pytest

from mpi_launch import SharedChecks


# by HVD_SGP_LOCAL_SIZE ("": the machine is one node)
LAYOUTS = {"": SharedChecks("join_checks.py", local_size=""),
           "1": SharedChecks("join_checks.py", worlds=[2, 3, 4]),
           "2": SharedChecks("join_checks.py", worlds=[4], local_size="2")}


@pytest.mark.parametrize("n,local_size", [(2, ""), (3, ""), (4, ""), (2, "1"), (3, "1"),
                                          (4, "1"), (4, "2")])
def test_join_with_uneven_data(n, local_size):
    out = LAYOUTS[local_size].run(n, timeout=600)
    assert f"all join checks passed on {n} ranks" in out
    print(out)
