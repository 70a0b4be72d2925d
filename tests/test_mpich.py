"""hvd_sgp under MPICH (the PyPI ``mpich`` package and its Hydra ``mpiexec``), in a fresh
virtual environment of its own: the runtime, the launcher detection and exact gossip."""
import venv
from pathlib import Path

from mpi_launch import run_checked as run

REPO = Path(__file__).resolve().parent.parent
JOB = """
import numpy as np
from hvd_sgp.common import gossip_average, init, rank, runtime, size
init()
assert runtime.detect_launcher().name == "mpich" and "MPICH" in runtime.mpi_library()
out = gossip_average(np.full(3, float(rank())), steps=2)  # exponential graph, n = 4
assert np.abs(out - (size() - 1) / 2).max() < 1e-12, out
print("mpich ok", rank(), size(), runtime.mpi_threads_supported(), flush=True)
"""


def test_runtime_and_gossip_under_mpich(tmp_path):
    venv.create(tmp_path / "env", with_pip=True)
    bin_dir = tmp_path / "env" / "bin"
    run(bin_dir / "pip", "install", "--quiet", "numpy", "mpi4py", "mpich")
    run(bin_dir / "pip", "install", "--quiet", "--no-deps", REPO)
    out = run(bin_dir / "mpiexec", "-n", "4", bin_dir / "python", "-c", JOB, cwd=tmp_path,
              env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HVD_SGP_LOCAL_SIZE": "1"})
    assert out.count("mpich ok") == 4 and "True" in out, out
