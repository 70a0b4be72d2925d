"""Checkpoint and resume; run by test_resume.py. argv: MODE DIR with MODE one of
full (30 steps), crash (10 steps, checkpoint, then rank 0 is killed), resume (from step 10).
"""
import os
import signal
import sys

import torch

import hvd_sgp.torch as hvd

mode, folder = sys.argv[1], sys.argv[2]
hvd.init()
torch.set_num_threads(1)
me = hvd.rank()
torch.manual_seed(me)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), topology="random")


def run(first, last):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 * step + me)  # the same data order on resume
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()


def params():
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


checkpoint = os.path.join(folder, f"ckpt_{me}.pt")
if mode == "full":
    run(0, 30)
    torch.save(params(), os.path.join(folder, f"full_{me}.pt"))
elif mode == "crash":
    run(0, 10)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    hvd.barrier()
    if me == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    run(10, 1000)  # the others carry on until the job is torn down
else:
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    run(10, 30)
    torch.save(params(), os.path.join(folder, f"resumed_{me}.pt"))
