"""What a job started by Slurm must see; run by test_slurm.py through sbatch, srun, mpirun and
sgprun inside a one-machine Slurm cluster.

``check_one_world`` (numpy core only, quick to start): the ranks form ONE world of
SLURM_NTASKS ranks, all inside the same Slurm job (srun without PMIx gives N worlds of one
rank each, silently), and PushSum gossip on the exponential graph gives the exact average.
``check_survives_a_killed_rank`` (torch, under sgprun --fault-tolerant): the last rank
SIGKILLs itself at step 3; the survivors repair (weights summing to their number) and finish
on one rank fewer.
"""
import math
import os
import signal
import sys

import numpy as np

from hvd_sgp.common import PushSumMixer, allocate, init, runtime
from hvd_sgp.common.mpi import MPI
from hvd_sgp.common.topology import make_topology
from hvd_sgp.common.transport import PeerTransport
from mpi_checks import Checks

KILL_STEP, STEPS = 3, 12

if "check_survives_a_killed_rank" in sys.argv:
    import hvd_sgp.torch as hvd  # the repair runs in the optimizer's step

    hvd.init()
else:
    init()
checks = Checks("slurm", runtime.rank, runtime.size, lambda: runtime.world_comm().Barrier(),
                lambda value: runtime.world_comm().allgather(value))


@checks
def check_one_world():
    comm = runtime.world_comm()
    n, me = comm.Get_size(), comm.Get_rank()
    job = os.environ.get("SLURM_JOB_ID")
    jobs = comm.allgather(job)
    checks.verify(f"one world of {n} ranks = SLURM_NTASKS, all in Slurm job {job}",
                  job is not None and len(set(jobs)) == 1
                  and os.environ.get("SLURM_NTASKS") == str(n),
                  f"jobs {jobs}, SLURM_NTASKS {os.environ.get('SLURM_NTASKS')}, "
                  f"launcher {runtime.detect_launcher().name}")
    values = np.random.default_rng(me).normal(size=100)
    truth = comm.allreduce(values) / n
    buf = allocate(values.size, np.float64)
    buf[:-1] = values
    mixer = PushSumMixer(buf, make_topology("exponential", n), PeerTransport(comm))
    steps = max(1, math.ceil(math.log2(n)))
    for _ in range(steps):
        mixer.mix()
    error = comm.allreduce(float(np.abs(buf[:-1] - truth).max()), op=MPI.MAX)
    checks.verify(f"exponential graph: exact average after {steps} gossip steps",
                  error <= 1e-12, f"error {error:.1e}")


@checks
def check_survives_a_killed_rank():
    import torch

    size = hvd.size()
    victim = size - 1
    torch.manual_seed(runtime.origin_rank())  # different models: mixing has work to do
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    gen = torch.Generator().manual_seed(runtime.origin_rank())
    for step in range(STEPS):
        if step == KILL_STEP and runtime.origin_rank() == victim:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    repair = opt._sgp_session().engine.repairs[-1]
    checks.verify(f"rank {victim} killed at step {KILL_STEP}: {size} -> {hvd.size()} ranks "
                  f"finished {STEPS} steps", hvd.size() == size - 1
                  and repair["lost"] == [victim], f"lost {repair['lost']}")
    checks.verify("the repair left PushSum weights summing to the survivors' number",
                  abs(repair["after"][1] - hvd.size()) < 1e-9, f"after {repair['after']}")

checks.run()
