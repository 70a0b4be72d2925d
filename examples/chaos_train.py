"""The training script a chaos run (examples/chaos.py) launches under ``sgprun --fault-tolerant
--max-np``: digits in Horovod's elastic idiom, a commit per step, and hooks where a rank dies
when the driver orders it.

The driver writes an order ``KIND MOMENT`` to ``DIR/orders/ORIGIN`` (ORIGIN: the launch rank,
replacements counting on from -np); the rank with that origin dies at the next MOMENT it
reaches, by KIND: ``kill`` (SIGKILL), ``exit`` (``os._exit(1)``: gone without closing
anything) or ``stop`` (SIGSTOP: frozen; the driver resumes it later). The moments: ``step``
(between steps), ``in-node`` (the in-node gradient reduce), ``gossip`` (the SGP exchange at
the end of a step), ``allreduce`` (the same point in an AllReduce stage of the schedule),
``collective`` (the Horovod allreduce of the loss), ``join`` (hvd.join() at an epoch's end),
``commit`` (inside state.commit()). Each rank keeps ``DIR/ranks/ORIGIN`` (pid, rank, local
rank, size, time) current for the driver, and the rank 0 of the moment appends every completed
step to ``DIR/steps.log`` with the PushSum mass after it (the weights sum to the world's
size: a message counted twice would add weight); the end of the run checks it once more
into ``DIR/ledger.log``.
"""
import argparse
import faulthandler
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from bench_model import digits_split

import hvd_sgp.torch as hvd
from hvd_sgp.common import engine, runtime

parser = argparse.ArgumentParser(description="chaos-run training (see examples/chaos.py)")
parser.add_argument("--dir", required=True, help="the run's directory (orders, logs)")
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--whole", type=int, default=0, help="after the last epoch, commit until "
                    "the world has this many ranks again (30 s at most), so that the last "
                    "lost ranks' replacements join before the end")
parser.add_argument("--hidden", type=int, default=64, help="hidden width (964: 1M parameters, "
                    "4963: 25M)")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

# On a hang the driver asks every process of the run for its threads' stacks (SIGUSR1) before
# it ends the run: they land in DIR/stacks/PID.
os.makedirs(os.path.join(args.dir, "stacks"), exist_ok=True)
_stacks = open(os.path.join(args.dir, "stacks", str(os.getpid())), "w")
faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
hvd.init()
torch.set_num_threads(1)
origin = runtime.origin_rank()
for sub in ("orders", "ranks"):
    os.makedirs(os.path.join(args.dir, sub), exist_ok=True)


def append(name: str, line: str) -> None:
    with open(os.path.join(args.dir, name), "a") as log:
        log.write(line + "\n")


def report() -> None:
    """This rank's place, for the driver to pick victims (written whole, then renamed)."""
    path = os.path.join(args.dir, "ranks", str(origin))
    with open(path + ".tmp", "w") as out:
        json.dump({"pid": os.getpid(), "rank": hvd.rank(), "local_rank": hvd.local_rank(),
                   "local_size": hvd.local_size(), "size": hvd.size(), "time": time.time()},
                  out)
    os.replace(path + ".tmp", path)


def hook(moment: str) -> None:
    """Die here if the driver ordered this origin to die at ``moment``."""
    path = os.path.join(args.dir, "orders", str(origin))
    if not os.path.exists(path):
        return
    try:
        with open(path) as order:
            kind, wanted = order.read().split()
        if wanted != moment:
            return
        os.remove(path)
    except FileNotFoundError:  # withdrawn by the driver meanwhile
        return
    append("deaths.log", f"{time.time():.3f} {origin} {kind} {moment} {hvd.rank()} "
                         f"{hvd.local_rank()} {hvd.size()}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # resumed by the driver: this rank goes on, and finds itself excluded
    os._exit(1)


def wrap(cls, name: str, moment) -> None:
    """Call hook(moment(self)) before ``cls.name``: a moment inside the library's step."""
    method = getattr(cls, name)

    def hooked(self, *a, **kw):
        hook(moment(self))
        return method(self, *a, **kw)
    setattr(cls, name, hooked)


wrap(engine.GossipEngine, "reduce_gradients", lambda self: "in-node")
wrap(engine.GossipEngine, "end_step",
     lambda self: "allreduce" if self.stage.mode == "allreduce" else "gossip")

x_train, y_train, x_test, y_test = digits_split(0)
train_set = torch.utils.data.TensorDataset(x_train, y_train)
sampler = hvd.elastic.ElasticSampler(train_set, seed=args.seed)
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                            torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                            torch.nn.Linear(args.hidden, 10))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr,
                                                     momentum=0.9),
                                     named_parameters=model.named_parameters())


class CommitState(hvd.elastic.TorchState):
    """TorchState whose commit is a failure moment."""

    def save(self) -> None:
        hook("commit")
        super().save()


def check_mass(where: str) -> None:
    """The PushSum weights sum to the world's size (each rank holds one unit of mass)."""
    weight = float(optimizer.metrics()["weight"])
    total = float(hvd.allreduce(torch.tensor([weight], dtype=torch.float64), op=hvd.Sum,
                                name="chaos.mass"))
    if hvd.rank() == 0:
        append("ledger.log", f"{time.time():.3f} {where} size {hvd.size()} weights {total!r}")


def step_figures(loss: torch.Tensor) -> tuple:
    """The mean loss and the PushSum mass (the weights' sum) after a step, in one allreduce.
    Between steps no message is in flight, so the mass is the world's size exactly: a message
    counted twice, or a lost rank's share kept, shows in the step it happens."""
    weight = float(optimizer.metrics()["weight"])
    total = hvd.allreduce(torch.tensor([float(loss), weight], dtype=torch.float64), op=hvd.Sum,
                          name="chaos.loss")
    return float(total[0]) / hvd.size(), float(total[1])


def evaluate() -> float:
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean()
    return float(hvd.allreduce(accuracy, name="chaos.accuracy"))


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        for batch, (data, target) in enumerate(loader):
            report()
            hook("step")
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            hook("collective")
            mean, mass = step_figures(loss)
            state.step += 1
            sampler.record_batch(batch, args.batch_size)
            if hvd.rank() == 0:
                append("steps.log", f"{time.time():.3f} {state.step} {hvd.size()} {mean:.5f} "
                                    f"{mass!r} {sampler.epoch} {sampler.processed_num}")
            state.commit()
        hook("join")
        hvd.join()
        sampler.set_epoch(state.epoch + 1)
        state.epoch += 1  # (committed with the sampler's next epoch, as the loop will set it)
        state.commit()
    until = time.time() + 30
    while hvd.size() < args.whole and time.time() < until:
        time.sleep(0.05)
        state.commit()  # (a take-in comes here: HostsUpdatedInterrupt, then this loop again)


state = CommitState(model, optimizer, sampler=sampler, epoch=0, step=0)
train(state)
optimizer.synchronize_gossip()
check_mass("end")
accuracy = evaluate()
if hvd.rank() == 0:
    append("result.log", json.dumps({"accuracy": accuracy, "steps": state.step,
                                     "size": hvd.size(), "time": time.time()}))
