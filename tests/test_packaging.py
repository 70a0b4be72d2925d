"""The built wheel installs into a fresh virtual environment (core dependencies only), imports
with the version from one place, and runs a 2-rank job through its own sgprun."""
import sys
import venv
from pathlib import Path

from mpi_launch import run_checked as run

from hvd_sgp.version import __version__

REPO = Path(__file__).resolve().parent.parent
JOB = ("import numpy as np, hvd_sgp; from hvd_sgp.common import init, rank, gossip_average; "
       "init(); avg = gossip_average(np.full(4, float(rank())), steps=1); "
       "print(hvd_sgp.__version__, avg.tolist())")


def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp_path / "dist",
        REPO)
    wheels = list((tmp_path / "dist").glob("hvd_sgp-*.whl"))
    assert len(wheels) == 1 and __version__ in wheels[0].name
    venv.create(tmp_path / "env", with_pip=True)
    bin_dir = tmp_path / "env" / "bin"
    run(bin_dir / "pip", "install", "--quiet", wheels[0])
    out = run(bin_dir / "sgprun", "-np", "2", "--local-size", "1", bin_dir / "python", "-c", JOB,
              cwd=tmp_path)
    assert out.count(f"{__version__} [0.5, 0.5, 0.5, 0.5]") == 2, out
