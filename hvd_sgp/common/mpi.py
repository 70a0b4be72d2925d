"""The one place mpi4py is imported: MPI starts in runtime.init(), never at import, so launchers
and tools can import hvd_sgp without becoming MPI processes.

One rule for every communicator a failure may revoke (fault-tolerant mode): reduce with MPI's
own collectives on buffers (``comm.Allreduce``), never mpi4py's object ones (``allreduce``,
``reduce``, ``scan``, ``exscan``). mpi4py runs those point to point on a private duplicate of
the communicator, which ``Revoke`` does not reach: a rank whose partner has left the call for a
repair waits for it for ever, its own watchdog's revoke included (16 of 27 probe runs with a
spawned process alive, 3 of 38 without; 0 of 30 with ``Allreduce``: docs/faults.md).
tests/test_import_graph.py keeps hvd_sgp/common free of them."""
import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.thread_level = "multiple"
mpi4py.rc.finalize = True

from mpi4py import MPI  # noqa: E402  (rc must be set before this import)

__all__ = ["MPI"]
