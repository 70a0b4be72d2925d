"""Host discovery (``sgprun --host-discovery-script``) on real processes; run by
test_elastic.py.

An elastic training function in Horovod's idiom (hvd.elastic.run, TorchState, a commit per
step, a reset callback). The discovery script is ``cat HOSTS_FILE``; ``--change STEP:SPEC``
makes rank 0 rewrite the file after that step (``SPEC``: host:slots,...), as an outside agent
would, and the world follows at a later commit: every rank's reset callback prints the step it
was interrupted at, newcomers print where they joined, and every entry of the training function
checks that every rank holds the same parameters with PushSum weights summing to the world's
size (the fold of a planned change, or the sync). ``--kill ORIGIN:STEP`` SIGKILLs the process
launched (or spawned) as ORIGIN at that step: the survivors grow back to the discovered slots.
``--step-seconds`` paces the steps so that rank 0's poller (every second) sees a change before
the run ends.
"""
import argparse
import os
import signal
import time

import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--hosts-file", required=True)
parser.add_argument("--change", action="append", default=[], metavar="STEP:SPEC")
parser.add_argument("--kill", action="append", default=[], metavar="ORIGIN:STEP")
parser.add_argument("--step-seconds", type=float, default=0.2)
args = parser.parse_args()
changes = {int(step): spec for step, spec in (item.split(":", 1) for item in args.change)}
kills = {tuple(int(x) for x in item.split(":")) for item in args.kill}

hvd.init()
torch.set_num_threads(1)
origin = runtime.origin_rank()
torch.manual_seed(origin)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
entered = [runtime.replacement()]  # a newcomer says where it joined at its first entry


def on_reset():
    print(f"discovery: origin {origin} reset at step {state.step}: rank {hvd.rank()} of "
          f"{hvd.size()} on {runtime.host()}", flush=True)


state.register_reset_callbacks([on_reset])


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"discovery check failed on rank {hvd.rank()} (origin {origin}): "
                             f"{what}")


@hvd.elastic.run
def train(state):
    z = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = float((hvd.allreduce(z, op=hvd.Max) - hvd.allreduce(z, op=hvd.Min)).abs().max())
    weight = float(optimizer.metrics()["weight"])
    weights = float(hvd.allreduce(torch.tensor([weight], dtype=torch.float64), op=hvd.Sum))
    if entered[0]:
        entered[0] = False
        print(f"discovery: newcomer origin {origin} joined as rank {hvd.rank()} of "
              f"{hvd.size()} on {runtime.host()} at step {state.step}", flush=True)
    if hvd.rank() == 0:
        print(f"discovery: entry at step {state.step} on {hvd.size()} ranks: parameters "
              f"spread {spread:.1e}, weights sum {weights:g}", flush=True)
    expect(spread < 1e-6, f"parameters differ at the entry by {spread}")
    expect(abs(weights - hvd.size()) < 1e-9, f"weights sum {weights}, not {hvd.size()}")
    gen = torch.Generator().manual_seed(1000 * origin + state.step)
    while state.step < args.steps:
        if (origin, state.step) in kills:
            print(f"discovery: origin {origin} killed at step {state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
        state.step += 1
        if hvd.rank() == 0 and state.step in changes:
            with open(args.hosts_file, "w") as handle:
                handle.write(changes[state.step].replace(",", "\n") + "\n")
            print(f"discovery: hosts file now {changes[state.step]} after step {state.step}",
                  flush=True)
        time.sleep(args.step_seconds)
        state.commit()


train(state)
hosts = hvd.allgather_object(runtime.host())
origins = hvd.allgather_object(origin)
if hvd.rank() == 0:
    print(f"discovery: finished on {hvd.size()} ranks, origins by rank {origins}, hosts by rank "
          f"{hosts}", flush=True)
