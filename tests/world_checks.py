"""Several check scripts in one launch (mpi_launch.SharedChecks). Each argument is a script and
its own arguments in one shell-quoted string; each runs in turn as ``__main__`` in the same
processes, so every rank starts Python, torch and its first optimizer once for all of them.
Rank 0 marks where each begins and ends; an exception ends the launch (hvd_sgp's MPI_Abort
hook), and the scripts not reached are left to launches of their own."""
import os
import runpy
import shlex
import sys

from mpi_launch import MARK

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def mark(word: str, member: str) -> None:
    if RANK == 0:
        print(f"{MARK}{word} {member}", flush=True)


for member in sys.argv[1:]:
    mark("begin", member)
    script, *args = shlex.split(member)
    sys.argv = [os.path.join(HERE, script), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    mark("end", member)
