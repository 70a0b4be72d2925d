"""What a killed mpirun leaves (hvd_sgp/runner/session_dirs.py): the rule for what is left
over, in-process; then the failure it caused, reproduced with real mpiruns, and sgprun past it.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_sgp.runner import session_dirs
from mpi_launch import REPO, mpirun_path

HOST = socket.gethostname().split(".")[0]
LISTENER = "The PMIx server's listener thread failed to start"


def left_by_killed_head(root: Path, pid: int, host: str = HOST) -> Path:
    """The files a prterun of ``pid`` leaves in ``root`` when it is killed (as Open MPI 5.0.11
    writes them; the contents do not matter to the failure, only the names)."""
    directory = root / f"ompi.{pid}"
    (directory / "1").mkdir(parents=True)
    for name in (f"pmix.{host}.tool", f"pmix.{host}.tool.{pid}",
                 f"pmix.{host}.tool.prterun-{host}-{pid}@0"):
        (directory / name).write_text(f"prterun-{host}-{pid}@0.0;tcp4://127.0.0.1:1\n{pid}\n")
    return directory


def a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_only_this_users_dead_heads_on_this_machine_are_reclaimed(tmp_path):
    env = {"TMPDIR": str(tmp_path)}
    dead = left_by_killed_head(tmp_path, a_dead_pid())
    # A live pid that is not a head: the pid came round to another program.
    reused = left_by_killed_head(tmp_path, os.getpid())
    elsewhere = left_by_killed_head(tmp_path / "shared", a_dead_pid(), host="othernode")
    (tmp_path / "shared" / elsewhere.name).rename(tmp_path / elsewhere.name)
    unmarked = tmp_path / f"ompi.{a_dead_pid()}"
    unmarked.mkdir()
    other = tmp_path / "ompi.vm.0"
    other.mkdir()
    removed = session_dirs.reclaim(env)
    assert sorted(removed) == sorted([dead, reused])
    assert not dead.exists() and not reused.exists()
    assert (tmp_path / elsewhere.name).exists() and unmarked.exists() and other.exists()
    assert session_dirs.reclaim(env) == []


def test_where_prterun_puts_it():
    assert session_dirs.base({}) == Path("/tmp")
    assert session_dirs.base({"TMPDIR": "/scratch"}) == Path("/scratch")
    assert session_dirs.base({"TMPDIR": "/scratch",
                              "PRTE_MCA_prte_tmpdir_base": "/local"}) == Path("/local")


def _pids_to_come(count: int) -> range:
    """The next ``count`` pids the kernel will hand out (it counts up from the last one)."""
    last = int(Path("/proc/loadavg").read_text().split()[-1])
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    if last + count >= top:
        pytest.skip("the pids are about to wrap; the next ones cannot be foretold")
    return range(last + 1, last + 1 + count)


LIVE_HEAD_KEPT = """
import os, sys
from hvd_sgp.runner import session_dirs
head = os.getppid()
session_dirs.reclaim(os.environ)
assert os.path.isdir(os.path.join(os.environ["TMPDIR"], f"ompi.{head}")), "a live head's dir went"
print("kept", head, flush=True)
"""


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="needs Linux's /proc")
def test_a_killed_heads_directory_stops_the_next_mpirun_given_its_pid_but_not_sgprun(tmp_path):
    """The CI failure, made on purpose: directories as killed prteruns leave them, for each of
    the next 3000 pids. A plain mpirun gets one of those pids and stops before starting a rank;
    sgprun removes them first and runs, and the reclaiming never touches a live head's
    directory (each rank reclaims while its mpirun runs, then checks)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=os.pathsep.join(
                   [str(REPO), os.environ.get("PYTHONPATH", "")]))
    for pid in _pids_to_come(3000):
        left_by_killed_head(tmp_path, pid)
    plain = subprocess.run([mpirun_path(), "-np", "1", "true"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode != 0 and LISTENER in plain.stdout + plain.stderr, plain
    script = tmp_path / "live_head.py"
    script.write_text(LIVE_HEAD_KEPT)
    sgprun = subprocess.run([sys.executable, "-m", "hvd_sgp.runner.launch", "-np", "2",
                             sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert sgprun.returncode == 0, sgprun.stdout + sgprun.stderr
    assert sgprun.stdout.count("kept ") == 2, sgprun.stdout
    removed = re.search(r"sgprun: removed (\d+) session directories", sgprun.stderr)
    assert removed and int(removed.group(1)) >= 2990, sgprun.stderr
    # What sgprun left is a live head's: the suite's other lane (tests/conftest.py) starts
    # mpiruns meanwhile, and one given a pid of the range keeps its directory. Reclaimed
    # again, only those whose head still runs may stay.
    session_dirs.reclaim(env)
    left = [name for name in os.listdir(tmp_path) if name.startswith("ompi.")]
    assert all((match := session_dirs.NAME.fullmatch(name))
               and session_dirs.head_alive(int(match.group(1))) for name in left), left
