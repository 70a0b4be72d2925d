"""Stragglers. ``--pattern persistent``: one rank computes ``--slowdown`` times slower at every
step. ``--pattern transient``: at each step every rank is that much slower with probability
``--probability`` (the jitter of shared clusters). AllReduce waits for the slowest rank at every
step; SGP waits only for this step's in-peers; Overlap SGP absorbs up to tau steps of lag.
Prints iterations per second of the fast ranks per mode, side by side. (With a persistent
straggler every bounded-delay method ends at its pace: ranks can run at most tau steps per
graph hop ahead of it.)

    sgprun -np 4 python examples/straggler_benchmark.py --slowdown 3
    (or: mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 python examples/straggler_benchmark.py)
"""
import argparse
import time

import torch

import hvd_sgp.torch as hvd

MODES = {
    "AllReduce": dict(mode="allreduce"),
    "SGP 1-peer": dict(mode="sgp"),
    "OSGP tau=1": dict(mode="sgp", overlap=True, max_delay=1),
    "OSGP tau=2": dict(mode="sgp", overlap=True, max_delay=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", choices=("persistent", "transient"), default="persistent")
    parser.add_argument("--slowdown", type=float, default=3.0, help="a slow step's factor")
    parser.add_argument("--slow-rank", type=int, default=1, help="persistent: which rank")
    parser.add_argument("--probability", type=float, default=0.1,
                        help="transient: chance that a rank's step is slow")
    parser.add_argument("--compute-ms", type=float, default=20.0,
                        help="simulated compute per step of a normal rank")
    parser.add_argument("--params", type=int, default=1_000_000, help="model size")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    persistent = args.pattern == "persistent"
    slow = persistent and hvd.rank() == args.slow_rank % hvd.size()
    results = {}
    for name, kwargs in MODES.items():
        model = torch.nn.Linear(args.params // 100, 100, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), **kwargs)
        x = torch.randn(2, args.params // 100)
        draws = torch.rand(args.steps + 5, generator=torch.Generator().manual_seed(hvd.rank()))
        hvd.barrier()
        began = None
        for step in range(args.steps + 5):
            if step == 5:
                began = time.perf_counter()
            opt.zero_grad()
            model(x).sum().backward()
            slow_step = slow or (not persistent and draws[step] < args.probability)
            # the rank's compute, as a sleep so that a 2-core machine can host many ranks
            time.sleep(args.compute_ms / 1e3 * (args.slowdown if slow_step else 1.0))
            opt.step()
        opt.synchronize_gossip()
        rate = args.steps / (time.perf_counter() - began)
        fast = hvd.allgather_object(None if slow else rate)
        fast = [r for r in fast if r is not None]
        results[name] = (min(fast), sum(fast) / len(fast))
        hvd.barrier()
    if hvd.rank() == 0:
        ideal = 1e3 / args.compute_ms
        who = (f"rank {args.slow_rank} {args.slowdown:g}x slower at every step" if persistent
               else f"each step of each rank {args.slowdown:g}x slower with probability "
                    f"{args.probability:g}")
        print(f"{hvd.size()} ranks, {who}, {args.params / 1e6:g}M parameters, "
              f"{args.compute_ms:g} ms compute per normal step")
        print("| mode | fast ranks it/s (mean) | slowest fast rank it/s | vs. compute alone |")
        print("| --- | --- | --- | --- |")
        for name, (worst, mean) in results.items():
            print(f"| {name} | {mean:.1f} | {worst:.1f} | {mean / ideal:.2f} |")


if __name__ == "__main__":
    main()
