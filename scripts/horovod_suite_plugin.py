"""pytest plugin of scripts/horovod_suite.py: one line per finished test phase, written at once.

Why not pytest's own report: a batch killed because one test hangs must still tell which tests
ended before it and how. Each rank appends to ``$HVD_SGP_SUITE_REPORT.<rank>`` lines of
``<test> <passed|failed|skipped> <first error or skip reason>``.
"""
from __future__ import annotations

import os

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def _path() -> str | None:
    base = os.environ.get("HVD_SGP_SUITE_REPORT")
    if not base:
        return None
    rank = next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), "0")
    return f"{base}.{rank}"


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext.strip().splitlines()
    errors = [line[1:] for line in text if line.startswith("E ")]
    return (errors or text[-1:] or [""])[0]


def pytest_runtest_logreport(report) -> None:
    """Record the call phase, and a setup or teardown phase that did not pass."""
    path = _path()
    if path is None or (report.when != "call" and report.passed):
        return
    name = report.nodeid.rsplit("::", 1)[-1]
    reason = "" if report.passed else " ".join(_reason(report).split())[:300]
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"{name} {report.outcome} {reason}\n")
