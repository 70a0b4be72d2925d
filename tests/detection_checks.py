"""How fast the survivors learn of a lost rank, by how it died; run by test_chaos.py under
``sgprun --fault-tolerant`` (its transports and PRRTE settings; detector timeout 8 s).

Rank 1 dies (``argv[1]``: ``kill`` SIGKILL, ``exit`` os._exit(1), ``exit0`` os._exit(0)) one
second after a barrier; every other rank waits on a receive from it and prints how long after
the death the receive failed with a lost-peer error. Plain mpi4py: what is measured is MPI's
and the launcher's notice, not hvd_sgp's repair.
"""
import os
import signal
import sys
import time

from mpi4py import MPI

how, stamp = sys.argv[1], sys.argv[2]  # stamp: a file where the victim writes its time
comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
comm.Barrier()
if comm.rank == 1:
    time.sleep(1.0)
    with open(stamp + ".tmp", "w") as out:
        out.write(repr(time.time()))
    os.replace(stamp + ".tmp", stamp)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0 if how == "exit0" else 1)
request = comm.Irecv(bytearray(8), source=1, tag=5)
began = time.time()
while time.time() - began < 30:
    try:
        if request.Test():
            raise SystemExit(f"rank {comm.rank}: a message from the dead rank 1")
    except MPI.Exception as error:
        with open(stamp) as f:
            died = float(f.read())
        print(f"rank {comm.rank} noticed after {time.time() - died:.3f} s "
              f"(class {error.Get_error_class()})", flush=True)
        break
    time.sleep(0.005)
else:
    print(f"rank {comm.rank} noticed nothing in 30 s", flush=True)
sys.stdout.flush()
os._exit(0)  # without MPI_Finalize, which would wait for the dead rank
