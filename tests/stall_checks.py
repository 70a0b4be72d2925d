"""A training job where rank 3 stops (SIGSTOP) or leaves its loop early at step 5, just before
one place where the others wait on it; or where rank 0 alone loads its checkpoint of step 2 at
step 5 (no broadcasts); run by test_stall.py.

argv: PLACE FAULT, with PLACE one of step (gossip and the in-node gradient sum, by layout),
allreduce (an AllReduce SGD stage), collective (a Horovod allreduce) or join, and FAULT stop,
fewer or load. The job must end non-zero on every rank with an error naming rank 3 (rank 0
and the others' iterations, for load): never a hang.
"""
import os
import signal
import sys
import time

import torch

import hvd_sgp.torch as hvd

place, fault = sys.argv[1:3]
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               mode="allreduce" if place == "allreduce" else "sgp")
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(200):
    if step == 2:
        saved = opt.state_dict()
    if step == 5 and fault == "load":
        if hvd.rank() == 0:
            print(f"fault injected at {time.time():.3f}", flush=True)
            opt.load_state_dict(saved)
    elif step == 5:
        if hvd.rank() == 3:
            print(f"fault injected at {time.time():.3f}", flush=True)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)  # (mpirun may continue it when it ends the job)
            sys.exit(0)  # fewer steps: this rank ends its script
        if place == "join":
            hvd.join()
            break
        if place == "collective":
            hvd.allreduce(torch.ones(2), name="loss")
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    time.sleep(0.01)
print("finished without noticing the fault", flush=True)
