"""Horovod's collective API on real MPI processes: negotiation, errors on every rank, process
sets, join and its participant hook, deadlines, CPU use of a blocked rank, TF's side."""
import os
import subprocess
import sys

import pytest

from mpi_launch import REPO, SharedChecks, run_mpi


CHECKS = SharedChecks("horovod_api_checks.py", worlds=[1, 2, 3, 4])
TF_CHECKS = SharedChecks("horovod_api_tf_checks.py", worlds=[2], needs="tensorflow")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_horovod_api_checks(n):
    out = CHECKS.run(n, timeout=600)
    assert f"all horovod api checks passed on {n} ranks" in out
    print(out)


def test_blocked_rank_leaves_the_core():
    out = run_mpi(2, "horovod_api_checks.py", "check_blocked_rank_cpu").stdout
    assert "uses < 10% of a core" in out
    print(out)


def test_timeouts_and_stall_warning_name_the_missing_rank():
    """A late rank: the stall warning after 1 s and the timeout after 2 s name it, every
    waiting rank fails, later collectives fail at once; a silent coordinator is named too."""
    proc = run_mpi(3, "horovod_api_checks.py", "check_timeouts", timeout=120,
                   env={"HVD_SGP_TIMEOUT": "2", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert all(f"timeouts ok on rank {r}" in proc.stdout for r in range(3)), proc.stdout
    assert "stall: allreduce 't' has waited 1 s for rank 2 (submitted by ranks 0, 1)" \
        in proc.stderr, proc.stderr


def test_stall_warning_can_be_disabled():
    proc = run_mpi(3, "horovod_api_checks.py", "check_timeouts", timeout=120,
                   env={"HVD_SGP_TIMEOUT": "2", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                        "HOROVOD_STALL_CHECK_DISABLE": "1"})
    assert "timeouts ok on rank 0" in proc.stdout and "stall:" not in proc.stderr


def test_tensorflow_collectives():
    out = TF_CHECKS.run(2, timeout=600)
    assert "all horovod api tf checks passed on 2 ranks" in out


def test_core_imports_no_framework_and_starts_no_mpi():
    code = ("import sys; import hvd_sgp.common.horovod_api.basics, hvd_sgp.common.horovod_api.join;"
            "from hvd_sgp.common.mpi import MPI; assert not MPI.Is_initialized();"
            "assert not {'torch', 'tensorflow'} & set(sys.modules), 'framework imported'")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_settings_from_environment():
    sys.path.insert(0, str(REPO))
    from hvd_sgp.common.errors import SgpValueError
    from hvd_sgp.common.horovod_api.negotiation import Settings

    assert Settings.from_environ({}) == Settings(300.0, 60.0)
    assert Settings.from_environ({"HVD_SGP_TIMEOUT": "5", "HOROVOD_STALL_CHECK_TIME_SECONDS":
                                  "2"}) == Settings(5.0, 2.0)
    assert Settings.from_environ({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_warning is None
    with pytest.raises(SgpValueError, match="HVD_SGP_TIMEOUT"):
        Settings.from_environ({"HVD_SGP_TIMEOUT": "soon"})
