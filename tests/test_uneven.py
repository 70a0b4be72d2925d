"""Uneven workers and PushSum's numerator step (hvd_sgp/common/local_update.py).

On real MPI (uneven_checks.py): 4 single-rank nodes with 1, 2, 3 and 6 samples per step, each
minimising its own quadratic, end at the sample-weighted optimum under every exchange, and at
the plain mean without ``samples_per_step``; the same on 2 two-rank nodes, where the weighting
inside a node is the exact sum's; the weights still sum to n; equal samples change nothing.
"""
import pytest

from hvd_sgp.common import options
from hvd_sgp.common.errors import OptionError
from hvd_sgp.runner import launch
from mpi_launch import SharedChecks


CHECKS = SharedChecks("uneven_checks.py", worlds=[4])
TWO_RANK_NODES = SharedChecks("uneven_checks.py",
                              "check_every_exchange_ends_at_the_sample_weighted_optimum",
                              "check_equal_samples_change_nothing", worlds=[4], local_size="2")


def test_uneven_checks_on_four_ranks():
    out = CHECKS.run(4)
    print(out)
    assert "all uneven checks passed on 4 ranks" in out


def test_two_rank_nodes():
    """HVD_SGP_LOCAL_SIZE=2: ranks of one node weigh their gradients inside the node's exact
    sum, and the nodes (3 and 9 samples) weigh their updates across."""
    out = TWO_RANK_NODES.run(4)
    print(out)
    assert "all uneven checks passed on 4 ranks" in out


def test_the_option_is_declared_once():
    """Keyword, variable and sgprun flag come from the one table; each rank has its own value
    (only whether it is set must agree)."""
    assert options.resolve(samples_per_step=24).samples_per_step == 24
    assert options.from_environment("samples_per_step", {"HVD_SGP_SAMPLES_PER_STEP": "8"}) == 8
    with pytest.raises(OptionError, match="samples_per_step"):
        options.resolve(samples_per_step=0)
    assert (options.resolve(samples_per_step=3).describe()
            == options.resolve(samples_per_step=5).describe())
    assert (options.resolve(samples_per_step=3).describe()
            != options.resolve().describe())
    args = launch.parse_args(["-np", "2", "--samples-per-step", "16", "python"])
    assert launch.sgp_environment(args)["HVD_SGP_SAMPLES_PER_STEP"] == "16"
