"""Suite-wide settings.

Bytecode: the suite's launches start hundreds of Python processes, each importing hvd_sgp and
the test helpers from this checkout. Where the environment turns bytecode caching off
(PYTHONDONTWRITEBYTECODE, as this project's sandbox does), every one of them compiled those
modules again: 0.16 s of CPU per process, measured. The launched processes may cache them
(in __pycache__/, which git ignores).

CPU per test: with SUITE_CPU_RECORD=FILE, each test appends a JSON line to FILE with its lane,
start and wall time and the CPU of pytest and of the processes it started and reaped (mpirun
reaps its ranks). On a 2-core machine the suite is bound by CPU more than by waits
(docs/faults.md), and the CPU says where a change can gain. (Not an HVD_SGP_* name: some
tests check every HVD_SGP_* variable their ranks see.) ``scripts/suite_cpu.py FILE`` sums it.

Two lanes: the suite runs in two pytest-xdist workers (``-n 2``, in pyproject.toml). The
launches whose ranks compute run one after another in one; the tests named in ``BESIDE`` (in
one process, or ranks that mostly wait: a deadline, a hang limit, a stopped rank or head) run
in the other, at a lower priority, in the cores the launches leave idle (one test after
another left a third of the 2 cores idle; 979 s -> 713 s, measured: docs/faults.md). Tests
that share a launch (``mpi_launch.SharedChecks``) stay in one lane, so each shared launch
runs once. The lanes are chosen from test ids: the controller that schedules them never
collects the tests.

Killed mpiruns: each test starts with none of their session directories left on this machine
(hvd_sgp/runner/session_dirs.py: a later mpirun given the same pid would stop before starting
a rank). The suite kills heads on purpose, and a machine may hold other runs' leftovers.
"""
import importlib.util
import json
import os
import resource
import time

import pytest

from hvd_sgp.runner import session_dirs

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
CPU_RECORD = os.environ.get("SUITE_CPU_RECORD", "")


def _cpu() -> tuple[float, float]:
    own, reaped = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_RECORD:
        yield
        return
    (own, reaped), began = _cpu(), time.time()
    yield
    own_after, reaped_after = _cpu()
    with open(CPU_RECORD, "a", encoding="utf-8") as record:
        record.write(json.dumps({"test": item.nodeid, "lane": lane(item.nodeid),
                                 "began": round(began, 2), "wall": round(time.time() - began, 2),
                                 "cpu_pytest": round(own_after - own, 2),
                                 "cpu_processes": round(reaped_after - reaped, 2)}) + "\n")


BESIDE = (  # modules, tests (with all their parameters), or test ids
    "tests/test_compression_properties.py",  # one process
    "tests/test_digits_data.py",
    "tests/test_elastic_sampler.py",
    "tests/test_dockerfile.py",
    "tests/test_import_graph.py",
    "tests/test_mixers.py",
    "tests/test_planners.py",
    "tests/test_properties.py",
    "tests/test_sim.py",
    "tests/test_stopped.py",
    "tests/test_topology.py",
    "tests/test_faults.py",  # one process, and ranks that fail at once or freeze
    "tests/test_runner.py",  # sgprun's command lines, and ranks that do nothing
    "tests/test_horovod.py",
    "tests/test_horovod_compatibility.py",
    "tests/test_ecosystem.py",  # mostly pip resolving or installing
    "tests/test_packaging.py",
    "tests/test_mpich.py",
    "tests/test_horovod_suite.py",  # ranks that wait out hang limits
    "tests/test_stall.py",  # ranks that wait out a deadline
    "tests/test_horovod_api.py::test_blocked_rank_leaves_the_core",
    "tests/test_horovod_api.py::test_timeouts_and_stall_warning_name_the_missing_rank",
    "tests/test_horovod_api.py::test_stall_warning_can_be_disabled",
    "tests/test_chaos.py::test_a_frozen_head_does_not_hold_sgprun_forever",
    "tests/test_chaos.py::test_ranks_whose_launcher_is_gone_exit",
    "tests/test_slurm.py",  # Slurm's daemons and small jobs
    "tests/test_benchmark.py::test_benchmark_tiny",  # 2 ranks, one launch after another
    "tests/test_benchmark.py::test_benchmark_local_tiny",
    "tests/test_tensorflow.py::test_tensorflow_checks[1]",  # 1 rank
)


def lane(nodeid: str) -> str:
    """``beside`` for a test of BESIDE, else ``launches``."""
    test = nodeid.split("[", 1)[0]
    return "beside" if any(nodeid == named or test == named or test.startswith(named + "::")
                           for named in BESIDE) else "launches"


if importlib.util.find_spec("xdist"):  # (pytest refuses a conftest's hook it does not know)
    def pytest_xdist_make_scheduler(config, log):
        """xdist's scope scheduling (each scope whole on one worker) with the lanes as scopes."""
        from xdist.scheduler import LoadScopeScheduling

        class Lanes(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return lane(nodeid)

        return Lanes(config, log)


BESIDE_NICENESS = 10


def pytest_runtest_setup(item):
    """Reclaim killed heads' directories. In the beside worker, lower its priority (and its
    processes') to BESIDE_NICENESS: the launches' ranks, which wait on each other step by
    step, then take the cores first, and the beside lane the time they leave."""
    session_dirs.reclaim(os.environ)
    if os.environ.get("PYTEST_XDIST_WORKER") and lane(item.nodeid) == "beside":
        os.nice(max(0, BESIDE_NICENESS - os.nice(0)))
