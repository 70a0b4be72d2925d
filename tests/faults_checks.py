"""A training job in which one rank misbehaves at step 5; run by test_faults.py.

argv: freeze | die | nan. The job must end non-zero on every rank, with an error naming rank 2.
"""
import os
import sys
import time

import torch

import hvd_sgp.torch as hvd

hvd.init()
torch.set_num_threads(1)
fault = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               topology="complete")
for step in range(1000):
    if step == 5 and hvd.rank() == 2:
        print(f"fault injected at {time.time():.3f}", flush=True)
        if fault == "freeze":
            time.sleep(3600)
        elif fault == "die":
            os._exit(3)
        elif fault == "nan":
            with torch.no_grad():
                model.weight.fill_(float("nan"))
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    time.sleep(0.01)
print("finished without noticing the fault", flush=True)
