"""Several check scripts in one launch (run by mpi_launch.run_checks): each runs in turn as
``__main__`` with no arguments, in the same processes, so every rank starts Python, torch and
its first optimizer once for all of them. Rank 0 marks where each begins and ends; an
exception ends the launch (hvd_sgp's MPI_Abort hook), and the scripts not reached are left to
launches of their own."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def mark(word: str, script: str) -> None:
    if RANK == 0:
        print(f"=== world_checks {word} {script}", flush=True)


for script in sys.argv[1:]:
    mark("begin", script)
    sys.argv = [os.path.join(HERE, script)]
    runpy.run_path(sys.argv[0], run_name="__main__")
    mark("end", script)
