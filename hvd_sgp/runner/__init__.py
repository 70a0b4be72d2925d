"""sgprun: launch an hvd_sgp (or Horovod) training script on many processes, as horovodrun does.

``launch`` parses horovodrun's flags plus the SGP ones and starts the job through ``mpirun``
(Open MPI or MPICH hydra) or ``srun``; ``check_build`` reports what this installation can use.
The runner never imports ``mpi4py.MPI``: the launching process must not become an MPI process.
"""
