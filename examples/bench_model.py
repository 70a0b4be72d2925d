"""The benchmark's model and data: real compute from a small network, chosen message size.

Why: the question a benchmark answers is how long one step takes when the fused parameter
buffer has a given size (ResNet-50's 25.6M parameters by default) and the compute takes a
given time. A small MLP gives real forward/backward work; one large ``payload`` parameter
with a cheap gradient pads the buffer to the chosen size; an optional sleep adds fixed
compute time (a GPU's share of the step, which leaves the CPU to the network).
"""
from __future__ import annotations

import gc
import os
import resource
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

import digits_data

RESNET50_PARAMETERS = 25_557_032


class PayloadMLP(torch.nn.Module):
    """An MLP on 64 features (digits' 8x8 images) plus a payload making ``parameters`` total."""

    def __init__(self, parameters: int, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, classes))
        small = sum(p.numel() for p in self.net.parameters())
        self.payload = torch.nn.Parameter(torch.zeros(max(parameters - small, 1)))

    def forward(self, x: torch.Tensor, decay: float = 1e-7):
        """Logits, and a linear penalty giving the payload the cheapest full gradient (the
        constant ``decay``: one read forward, one write backward); both come out of forward so
        that DistributedDataParallel sees every parameter used."""
        return self.net(x), decay * self.payload.sum()

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class DeepMLP(torch.nn.Module):
    """``layers`` Linear layers (64 -> w, w -> w ..., w -> 10) whose width w makes about
    ``parameters`` in all: many tensors of real compute, as a model whose gradients arrive
    one tensor at a time (the 16-layer default gives ResNet-50's 25.6M in 32 tensors)."""

    def __init__(self, parameters: int, layers: int = 16, features: int = 64,
                 classes: int = 10):
        super().__init__()
        if layers < 2:
            raise ValueError(f"DeepMLP needs at least 2 layers, got {layers}")
        # (layers - 2) w^2 + (features + classes + layers - 1) w + classes = parameters
        a, b = layers - 2, features + classes + layers - 1
        width = (max(1, round((parameters - classes) / b)) if a == 0 else
                 max(1, round((-b + (b * b + 4 * a * (parameters - classes)) ** 0.5) / (2 * a))))
        sizes = [features] + [width] * (layers - 1) + [classes]
        blocks = []
        for i, (m, n) in enumerate(zip(sizes, sizes[1:])):
            blocks.append(torch.nn.Linear(m, n))
            if i < layers - 1:
                blocks.append(torch.nn.ReLU())
        self.net = torch.nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor):
        """Logits, and a zero penalty (the same interface as PayloadMLP)."""
        return self.net(x), 0.0

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def make_model(parameters: int, hidden: int = 256, layers: int = 0) -> torch.nn.Module:
    """A DeepMLP of ``layers`` layers, or (layers = 0) a PayloadMLP."""
    return DeepMLP(parameters, layers) if layers else PayloadMLP(parameters, hidden)


def synthetic_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch: the throughput runs measure time, not learning."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)


def digits_split(seed: int = 0):
    """scikit-learn's digits, scaled to [0, 1]: (x_train, y_train, x_test, y_test)."""
    x_train, x_test, y_train, y_test = map(torch.from_numpy, digits_data.split(0.25, seed=seed))
    return x_train, y_train, x_test, y_test


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, extra_seconds: float = 0.0, set_to_none: bool = True) -> None:
    """Forward, backward, the optional fixed compute time, and the (distributed) step;
    ``set_to_none`` is zero_grad's (torch's default, what a typical script passes)."""
    optimizer.zero_grad(set_to_none=set_to_none)
    logits, penalty = model(x)
    (F.cross_entropy(logits, y) + penalty).backward()
    if extra_seconds > 0:
        time.sleep(extra_seconds)
    optimizer.step()


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scheduler_seconds() -> tuple[float, float]:
    """Seconds this process's threads have run on a CPU and waited runnable for one (Linux
    /proc/self/task/*/schedstat): run + wait over a wall interval is the share of a core the
    process asked for, whether or not other load let it run (a spinning or sched_yield-ing
    wait asks for a whole core; a sleeping one for almost nothing)."""
    import os
    run = wait = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # the thread ended meanwhile
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run / 1e9, wait / 1e9


def tx_bytes(interface: str) -> int:
    """Bytes sent on ``interface`` (inside a virtual-cluster host: its shaped veth)."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())


def one_process_runs(keys: Iterable[str], kept: tuple,
                     environment: Callable[[str], dict]) -> Iterator[str]:
    """Several benchmark runs in one launch (start-up is slow): each sees only its own
    HVD_SGP_ variables (``kept`` stay), and the previous run's optimizer and its engine are
    collected before the next starts."""
    for key in keys:
        for name in [v for v in os.environ if v.startswith("HVD_SGP_") and v not in kept]:
            del os.environ[name]
        os.environ.update(environment(key))
        yield key
        gc.collect()
