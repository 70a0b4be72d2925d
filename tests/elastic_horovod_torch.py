"""A synthetic benchmark in the shape of Horovod's elastic PyTorch example (only the import
line differs from a Horovod script, plus --kill-rank to lose one rank on purpose): elastic.run,
TorchState with plain counters, a commit per batch, a reset callback scaling the rate."""
import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hvd_sgp.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--num-warmup-batches", type=int, default=3)
parser.add_argument("--num-batches-per-iter", type=int, default=4)
parser.add_argument("--num-iters", type=int, default=6)
parser.add_argument("--num-batches-per-commit", type=int, default=1)
parser.add_argument("--kill-rank", type=int, default=-1)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 10))
lr = 0.01
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
data = torch.randn(args.batch_size, 3, 16, 16)
target = torch.LongTensor(args.batch_size).random_() % 10
launch_rank = hvd.rank()


def benchmark_step(state):
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()
    state.batch += 1
    if state.batch == args.num_batches_per_commit:
        state.batch = 0
        state.commit()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


@hvd.elastic.run
def run_benchmark(state):
    if not state.warm:
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
        state.warm = True
        state.commit()
    for x in range(state.iter, args.num_iters):
        if x == 2 and launch_rank == args.kill_rank:
            os._exit(1)
        time = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU ({hvd.size()} ranks)")
        state.img_secs.append(img_sec)
        state.iter = x
        state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)
img_sec_mean = np.mean(state.img_secs)
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * img_sec_mean:.1f}")
