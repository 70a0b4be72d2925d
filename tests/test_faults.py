"""A dead, frozen or diverged peer ends the whole job non-zero within the timeout plus a few
seconds, with an error naming the peer; never a hang."""
import re
import time

import pytest

from mpi_launch import run_mpi

TIMEOUT = 4


@pytest.mark.parametrize("fault, expected", [
    ("freeze", ["PeerTimeoutError", "rank 2", "at iteration 5", "stalled"]),
    ("die", []),
    ("nan", ["from rank 2", "NaN"]),
])
def test_faulty_peer_ends_the_job(fault, expected):
    proc = run_mpi(4, "faults_checks.py", fault, env={"HVD_SGP_TIMEOUT": str(TIMEOUT)},
                   timeout=120, check=False)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "finished without noticing" not in output
    for text in expected:
        assert text in output, (text, output[-3000:])
    injected = float(re.search(r"fault injected at ([0-9.]+)", output).group(1))
    print(f"{fault}: every rank gone {ended - injected:.1f} s after the fault")
    assert ended - injected < TIMEOUT + 10, ended - injected
