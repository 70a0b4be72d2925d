"""hvd.join() with uneven data on real MPI processes: rank r has BASE + 2 r batches, calls
join() when it runs out, and the others keep training (run by test_join.py on 2, 3 and 4 ranks,
in the layout the environment sets). Every training step also runs a negotiated Horovod
collective, which the joined ranks must serve while they serve the optimizer."""
import gc

import torch

import hvd_sgp.torch as hvd
from mpi_checks import Checks

hvd.init()
torch.set_num_threads(1)
me, n = hvd.rank(), hvd.size()
checks = Checks("join", hvd.rank, hvd.size, hvd.barrier, hvd.allgather_object)
BASE, LR = 2, 0.1


def batches(rank: int) -> int:
    return BASE + 2 * rank


def batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + k)
    x = torch.randn(8, 4, generator=gen)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=gen)


def model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Linear(4, 1)


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def train(**sgp) -> tuple[torch.nn.Module, object, int]:
    """Uneven training then join(); returns the model, the optimizer and join's answer."""
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.5),
                                   named_parameters=net.named_parameters(), **sgp)
    for k in range(batches(me)):
        x, y = batch(me, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        training = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name=f"training.{k}")
        expected = sum(batches(r) > k for r in range(n))
        assert int(training) == expected, (k, float(training), expected)
    return net, opt, hvd.join()


def reference() -> torch.Tensor:
    """One process's replay of exact data parallelism over the ranks that still have data:
    step k averages the gradients of the ranks with more than k batches."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.5)
    for k in range(batches(n - 1)):
        opt.zero_grad()
        ranks = [r for r in range(n) if batches(r) > k]
        for r in ranks:
            x, y = batch(r, k)
            (torch.nn.functional.mse_loss(net(x), y) / len(ranks)).backward()
        opt.step()
    return flat(net)


def agreed(value) -> bool:
    return len({repr(v) for v in hvd.allgather_object(value)}) == 1


@checks.when(hvd.cross_size() == 1)
def check_exact_data_parallelism():
    """One node, every gradient averaged exactly: uneven data trains as one process that
    averages the ranks with data, on every rank (the joined ranks were re-synced)."""
    net, opt, last = train()
    error = (flat(net) - reference()).abs().max().item()
    checks.verify("one node: join() equals exact data parallelism over the ranks with data",
                  error < 1e-5 and agreed(last) and 0 <= last < n, f"max error {error:.1e}")
    momentum = torch.cat([s["momentum_buffer"].reshape(-1) for s in opt.state.values()])
    checks.verify("joined ranks leave join() with the updating ranks' momentum",
                  agreed(momentum.tolist()))


@checks.when(hvd.cross_size() > 1)
def check_gossip():
    """SGP, Overlap SGP and AllReduce SGD across nodes: join() returns on every rank with the
    same answer and iteration; PushSum mass is conserved; ranks of one node agree; training
    went on (the loss fell) and the models can still be averaged exactly."""
    x, y = batch(99, 0)
    for name, sgp in {"sgp": {}, "overlap": dict(overlap=True), "allreduce": dict(mode="allreduce")
                      }.items():
        net, opt, last = train(**sgp)
        iteration = opt.metrics()["iteration"]
        mass = hvd.allreduce(torch.tensor(opt.metrics()["weight"], dtype=torch.float64),
                             op=hvd.Sum, name=f"mass.{name}") / hvd.local_size()
        checks.verify(f"{name}: join() agrees on its answer and the iteration, mass conserved",
                      # a last joiner may begin steps no one needed before all have joined
                      agreed((last, iteration)) and iteration >= batches(n - 1)
                      and abs(float(mass) - hvd.cross_size()) < 1e-9,
                      f"last {last}, iteration {iteration}, mass {float(mass):.12f}")
        node = hvd.allgather_object((hvd.cross_rank(), flat(net).tolist()))
        checks.verify(f"{name}: the ranks of each node hold one model after join()",
                      all(p == q for (a, p) in node for (b, q) in node if a == b))
        before = torch.nn.functional.mse_loss(model()(x), y).item()
        opt.average_parameters()
        after = torch.nn.functional.mse_loss(net(x), y).item()
        checks.verify(f"{name}: exact average after join(), and it learned",
                      agreed(flat(net).tolist()) and after < before,
                      f"loss {before:.3f} -> {after:.3f}")
        del net, opt


@checks
def check_join_at_once_serves_nothing_and_skips_a_dropped_cycle():
    """Every rank joins at once: nothing is served (no zero-gradient step, which momentum
    would turn into a move), so join() does not collect garbage either (a full collection is
    0.1-0.2 s of CPU per rank with torch loaded), except where an optimizer dropped in a
    reference cycle may still be counted: one that took 5 steps, collected on rank 0 only,
    must not make the held one (3 steps) serve 2 more on the other ranks."""
    def steps(opt, net, count):
        for k in range(count):
            x, y = batch(me, k)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()

    def sgp(net):
        return hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR),
                                        named_parameters=net.named_parameters())
    dropped_net = model()
    dropped = sgp(dropped_net)
    steps(dropped, dropped_net, 5)
    dropped.cycle = dropped  # only the cycle collector frees it
    del dropped, dropped_net
    if me == 0:
        gc.collect()
    net = model()
    opt = sgp(net)
    steps(opt, net, 3)
    collections = [0]
    collect = gc.collect

    def counted(*args):
        collections[0] += 1
        return collect(*args)
    gc.collect = counted
    try:
        hvd.barrier()
        last = hvd.join()
        iteration = opt.metrics()["iteration"]
        # (4: a rank more than SERVE_AFTER_SECONDS late, and the others served it a step)
        checks.verify("a dropped optimizer in a cycle, collected on rank 0 only, is not served",
                      agreed(last) and agreed(iteration) and iteration in (3, 4),
                      f"iteration {iteration}, collections {collections[0]}")
        joins = []
        for _ in range(3):  # (one at once suffices: the old join() served and collected in all)
            collections[0] = 0
            steps(opt, net, 1)
            before = opt.metrics()["iteration"]
            hvd.barrier()
            hvd.join()
            joins.append(hvd.allgather_object(
                (collections[0], opt.metrics()["iteration"] - before)))
    finally:
        gc.collect = collect
    checks.verify("join() with every rank at once takes no step and collects no garbage",
                  any(all(j == (0, 0) for j in ranks) for ranks in joins), joins)


checks.run()
