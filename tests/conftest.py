"""Suite-wide settings.

Bytecode: the suite's launches start hundreds of Python processes, each importing hvd_sgp and
the test helpers from this checkout. Where the environment turns bytecode caching off
(PYTHONDONTWRITEBYTECODE, as this project's sandbox does), every one of them compiled those
modules again: 0.16 s of CPU per process, measured. The launched processes may cache them
(in __pycache__/, which git ignores).

CPU per test: with SUITE_CPU_RECORD=FILE, each test appends a JSON line to FILE with its wall
time and the CPU of pytest and of the processes it started and reaped (mpirun reaps its
ranks). On a 2-core machine the suite is bound by CPU, not by waits (docs/faults.md), and the
CPU says where a change can gain. (Not an HVD_SGP_* name: some tests check every HVD_SGP_*
variable their ranks see.)

Killed mpiruns: each test starts with none of their session directories left on this machine
(hvd_sgp/runner/session_dirs.py: a later mpirun given the same pid would stop before starting
a rank). The suite kills heads on purpose, and a machine may hold other runs' leftovers.
"""
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
    (own, reaped), began = _cpu(), time.monotonic()
    yield
    own_after, reaped_after = _cpu()
    with open(CPU_RECORD, "a", encoding="utf-8") as record:
        record.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - began, 2),
                                 "cpu_pytest": round(own_after - own, 2),
                                 "cpu_processes": round(reaped_after - reaped, 2)}) + "\n")


def pytest_runtest_setup(item):
    session_dirs.reclaim(os.environ)
