"""Elastic training that survives a lost rank: digits with Horovod's elastic API on SGP.

One rank dies on purpose at a chosen step (``--kill-rank``, ``--kill-step``; ``--kill-how``
exit or sigkill); the survivors repair the world in place, recover the state and go on. Run
it under ULFM, e.g. on 8 ranks, each its own SGP node:

    sgprun -np 8 --local-size 1 --fault-tolerant python examples/elastic_digits.py \\
        --kill-rank 3 --kill-step 60

Without ``--fault-tolerant`` the same script trains as a plain Horovod job (no kill then).
"""
import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F

import digits_data  # scikit-learn's digits, split once and cached
import hvd_sgp.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="elastic digits")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--batches-per-commit", type=int, default=5)
parser.add_argument("--kill-rank", type=int, default=-1, help="this rank dies (launch rank)")
parser.add_argument("--kill-step", type=int, default=-1, help="...before this global step")
parser.add_argument("--kill-how", choices=("exit", "sigkill"), default="exit")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)
launch_rank = hvd.rank()
if torch.cuda.is_available():  # ranks may share the GPUs (as Horovod's examples pin them)
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

x_train, x_test, y_train, y_test = map(torch.from_numpy, digits_data.split(0.25, seed=0))
x_test, y_test = x_test.to(device), y_test.to(device)
train_set = torch.utils.data.TensorDataset(x_train, y_train)
sampler = hvd.elastic.ElasticSampler(train_set, seed=args.seed)
loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                            momentum=args.momentum)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
events = {"resumed": None, "began": None}


def evaluate() -> float:
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean()
    return hvd.allreduce(accuracy, name="accuracy").item()


@hvd.elastic.run
def train(state):
    if events["began"] is None:  # a replacement (--max-np) begins at the last commit
        events["began"] = state.step
    for state.epoch in range(state.epoch, args.epochs):
        for batch, (data, target) in enumerate(loader):
            if (state.step == args.kill_step and launch_rank == args.kill_rank
                    and events["began"] < args.kill_step):
                print(f"rank {launch_rank} dies at step {state.step} at {time.time():.3f}",
                      flush=True)
                if args.kill_how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(1)
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            if events["resumed"] is not None:
                print(f"rank {hvd.rank()}: first step after the repair done at "
                      f"{time.time():.3f} ({hvd.size()} ranks)", flush=True)
                events["resumed"] = None
            state.step += 1
            sampler.record_batch(batch, args.batch_size)
            if state.step % args.batches_per_commit == 0:
                state.commit()
        accuracy = evaluate()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch + 1:2d}  test accuracy {accuracy:.4f}  "
                  f"({hvd.size()} ranks)", flush=True)
        sampler.set_epoch(state.epoch + 1)
        state.epoch += 1  # (committed with the sampler's next epoch, as the loop will set it)
        state.commit()
    return accuracy


def on_reset():
    """A rank was lost: the learning rate follows the new number of ranks, as in Horovod."""
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()
    events["resumed"] = time.time()
    if hvd.rank() == 0:
        print(f"reset: {hvd.size()} ranks go on (launch rank {launch_rank} is now rank "
              f"{hvd.rank()})", flush=True)


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
state.register_reset_callbacks([on_reset])
final = train(state)
if hvd.rank() == 0:
    print(f"final test accuracy {final:.4f} on {hvd.size()} ranks", flush=True)
