"""Every place a rank waits, in every layout: when one rank stops (SIGSTOP) or runs fewer
steps, every other rank ends within HVD_SGP_TIMEOUT + 5 s with an error naming it; never a
silent hang. Blocking collectives end through the watchdog (watchdog.py), polled waits through
their Wait (waiting.py)."""
import re
import time

import pytest

from mpi_launch import run_mpi

TIMEOUT = 3
LAYOUTS = {"one node": "", "single-rank nodes": "1", "two-rank nodes": "2"}
CASES = [(place, layout, "stop") for place, layouts in (
    ("step", ("one node", "single-rank nodes", "two-rank nodes")),
    ("allreduce", ("one node", "single-rank nodes", "two-rank nodes")),
    ("collective", ("one node", "single-rank nodes", "two-rank nodes")),
    ("join", ("one node", "single-rank nodes", "two-rank nodes"))) for layout in layouts]
CASES += [("step", "one node", "fewer"), ("step", "two-rank nodes", "fewer"),
          ("step", "single-rank nodes", "fewer")]


@pytest.mark.parametrize("place, layout, fault", CASES)
def test_a_late_rank_ends_the_job_naming_it(place, layout, fault):
    proc = run_mpi(4, "stall_checks.py", place, fault, check=False, timeout=150,
                   env={"HVD_SGP_TIMEOUT": str(TIMEOUT), "HVD_SGP_LOCAL_SIZE": LAYOUTS[layout]})
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "finished without noticing" not in output, output[-3000:]
    errors = [line for line in output.splitlines()
              if re.search(r"waited|timed out|no answer|the job ends", line)]
    assert any(re.search(r"\brank 3\b|ranks [0-9, ]*\b3\b", line) for line in errors), \
        output[-3000:]
    injected = float(re.search(r"fault injected at ([0-9.]+)", output).group(1))
    print(f"{place} / {layout} / {fault}: every rank gone {ended - injected:.1f} s after the fault")
    assert ended - injected < TIMEOUT + 5, (ended - injected, output[-3000:])
