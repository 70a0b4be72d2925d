"""The one place mpi4py is imported: MPI starts in runtime.init(), never at import, so launchers
and tools can import hvd_sgp without becoming MPI processes."""
import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.thread_level = "multiple"
mpi4py.rc.finalize = True

from mpi4py import MPI  # noqa: E402  (rc must be set before this import)

__all__ = ["MPI"]
