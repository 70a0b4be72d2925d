"""Does this Open MPI crash a survivor when a peer dies while a communicator is being created?
python scripts/comm_create_crash.py [LAUNCHES] [NP]

Each launch (mpirun with ULFM and its detector, NP ranks) creates and frees communicators
(MPI_Comm_split) in a loop while one rank, chosen by the launch's seed, is SIGKILLed 0.2-0.6 s
in. Survivors should see MPI_ERR_PROC_FAILED; Open MPI 5.0.10 and 5.0.11 instead crash some of
them in ompi_comm_revoke_local (docs/faults.md, session 28). Prints the launches with a
crashed rank, the crashed ranks, and those in ompi_comm_revoke_local; 5.0.11 gave 7 of 24,
5.0.9 0. The MPI flags are sgprun --fault-tolerant's that matter here, written out so that
the script needs only mpi4py."""
import os
import random
import signal
import subprocess
import sys
import threading

ULFM = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "btl", "^sm,ofi",
        "--prtemca", "state_base_recoverable", "1", "--prtemca", "state_base_notify_errors", "1",
        "--prtemca", "state_base_error_non_zero_exit", "0", "--oversubscribe"]


def rank(seed: int) -> None:
    """One rank: split until an error; the victim is killed meanwhile."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rng = random.Random(seed)
    victim = 1 + rng.randrange(world.Get_size() - 1)
    if world.Get_rank() == victim:
        threading.Timer(rng.uniform(0.2, 0.6), os.kill, (os.getpid(), signal.SIGKILL)).start()
    splits = 0
    try:
        while True:
            comm = world.Split(0, world.Get_rank())
            comm.Free()
            splits += 1
    except MPI.Exception as error:
        print(f"rank {world.Get_rank()}: {error.Get_error_string()} after {splits} splits",
              flush=True)
    os._exit(0)


def main(launches: int = 24, size: int = 4) -> None:
    crashed_launches = crashed = in_revoke = 0
    for seed in range(launches):
        out = subprocess.run(["mpirun", "-n", str(size), *ULFM, sys.executable, __file__,
                              "--rank", str(seed)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=120).stdout
        crashes = out.count("Segmentation fault")
        crashed_launches += crashes > 0
        crashed += crashes
        in_revoke += out.count("ompi_comm_revoke_local")
    print(f"{launches} launches of {size} ranks: {crashed_launches} with a crashed rank, "
          f"{crashed} ranks crashed, {in_revoke} in ompi_comm_revoke_local")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank(int(sys.argv[2]))
    else:
        main(*(int(arg) for arg in sys.argv[1:3]))
