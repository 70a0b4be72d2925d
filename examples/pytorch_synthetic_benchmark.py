"""Horovod's synthetic benchmark, with hvd_sgp: throughput of a ResNet-like model (no
torchvision needed) or a configurable MLP on random data. Only the import differs from
Horovod's script; ``--allreduce`` runs the same model with exact AllReduce for comparison.

    sgprun -np 4 --local-size 1 python examples/pytorch_synthetic_benchmark.py --model mlp
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hvd_sgp.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--model", choices=("resnet", "mlp"), default="resnet")
parser.add_argument("--width", type=int, default=32, help="resnet channels / mlp hidden units")
parser.add_argument("--depth", type=int, default=4, help="resnet blocks / mlp hidden layers")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-warmup-batches", type=int, default=3)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--fp16-allreduce", action="store_true", help="gossip in fp16")
parser.add_argument("--allreduce", action="store_true", help="exact AllReduce instead of SGP")
parser.add_argument("--no-cuda", action="store_true")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def build_model() -> nn.Module:
    if args.model == "mlp":
        layers, size = [nn.Flatten()], 3 * args.image_size ** 2
        for _ in range(args.depth):
            layers += [nn.Linear(size, args.width), nn.ReLU()]
            size = args.width
        return nn.Sequential(*layers, nn.Linear(size, 1000))
    return nn.Sequential(nn.Conv2d(3, args.width, 3, padding=1, bias=False),
                         nn.BatchNorm2d(args.width), nn.ReLU(),
                         *[Block(args.width) for _ in range(args.depth)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(args.width, 1000))


hvd.init()
cuda = not args.no_cuda and torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(hvd.local_rank())
device = torch.device("cuda" if cuda else "cpu")
model = build_model().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     mode="allreduce" if args.allreduce else None)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
target = torch.randint(0, 1000, (args.batch_size,), device=device)


def benchmark_step():
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


parameters = sum(p.numel() for p in model.parameters())
log(f"Model: {args.model} ({parameters / 1e6:.2f}M parameters), batch size {args.batch_size}, "
    f"{'AllReduce' if args.allreduce else 'SGP'}, {hvd.size()} ranks, "
    f"{'GPU' if cuda else 'CPU'}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
rates = []
for x in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    rate = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{x}: {rate:.1f} img/sec per rank")
    rates.append(rate)
mean, spread = np.mean(rates), 1.96 * np.std(rates)
log(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
log(f"Total img/sec on {hvd.size()} ranks: {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
