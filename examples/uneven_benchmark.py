"""Uneven workers: one rank twice as slow, given half the batch, weighted by its samples.

Why: a persistent straggler sets every bounded-delay method's pace (README, Stragglers). The
remedy on a cluster of unlike machines is a smaller batch for the slow rank, so that every
rank's step takes the same time; ``samples_per_step`` then weighs each rank's gradients and
updates by the samples behind them (hvd_sgp/common/local_update.py). This measures, on the
digits CNN at n ranks (each its own SGP node), for each exchange (SGP, Overlap SGP, Local SGD
over gossip):

- even: every rank the same batch; the slow rank holds everyone up;
- uneven, weighted: the slow rank's batch divided by the slowdown, ``samples_per_step`` set;
- uneven, unweighted: the same batches without it.

A rank's compute is its real forward/backward plus a sleep of ``--sample-ms`` per sample
(times ``--slowdown`` on the slow rank): the emulated accelerator. Each rank's shard of the
training set is in proportion to its batch, so every rank ends an epoch at the same step and
each sample is seen once per epoch; every run trains the same number of epochs. Reported:
seconds per step and per epoch, and test accuracy after a final exact average (mean over
seeds, their range). Launch with every rank its own node:

    sgprun -np 4 --local-size 1 python examples/uneven_benchmark.py --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_model  # noqa: E402
from compression_benchmark import cnn  # noqa: E402

import hvd_sgp.torch as hvd  # noqa: E402

EXCHANGES = {"sgp": ("SGP", {}), "osgp": ("Overlap SGP, tau 1", {"overlap": True}),
             "local4": ("Local SGD H=4 over gossip",
                        {"local_steps": 4, "outer_optimizer": "sgd:1"})}
LAYOUTS = ("even", "uneven, weighted", "uneven, unweighted")


def shard(x: torch.Tensor, y: torch.Tensor, batches: list[int], rank: int):
    """This rank's slice of the (shuffled) training set, in proportion to its batch."""
    edges = [round(len(x) * sum(batches[:r]) / sum(batches)) for r in range(len(batches) + 1)]
    return x[edges[rank]:edges[rank + 1]], y[edges[rank]:edges[rank + 1]]


def run(args, exchange: dict, layout: str, seed: int) -> dict:
    """One training run on this rank: seconds per step, and the averaged model's accuracy."""
    rank, size = hvd.rank(), hvd.size()
    slow = rank == args.slow_rank
    even = layout == "even"
    batches = [args.batch if even or r != args.slow_rank else
               max(1, round(args.batch / args.slowdown)) for r in range(size)]
    x_train, y_train, x_test, y_test = bench_model.digits_split()
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(1000 + seed))
    x, y = shard(x_train[order], y_train[order], batches, rank)
    torch.manual_seed(seed)
    model = cnn()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    weighted = layout == "uneven, weighted"
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        samples_per_step=batches[rank] if weighted else None, **exchange)
    batch, per_sample = batches[rank], args.sample_ms / 1000 * (args.slowdown if slow else 1)
    steps_per_epoch = len(x) // batch
    steps_per_epoch = min(hvd.allgather_object(steps_per_epoch))  # (rounding: the same)
    hvd.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        mine = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            rows = mine[i * batch:(i + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            time.sleep(per_sample * batch)  # the emulated accelerator
            optimizer.step()
    optimizer.synchronize_gossip()
    seconds = time.perf_counter() - start
    optimizer.average_parameters()
    steps = args.epochs * steps_per_epoch
    accuracy = bench_model.accuracy(model, x_test, y_test)
    return {"seconds": max(hvd.allgather_object(seconds)), "steps": steps,
            "accuracy": accuracy, "batches": batches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exchanges", nargs="*", choices=list(EXCHANGES), default=list(EXCHANGES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--slowdown", type=float, default=2.0, help="the slow rank's factor")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--sample-ms", type=float, default=1.0,
                   help="emulated compute per sample on a normal rank")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    results = []
    for key in args.exchanges:
        label, exchange = EXCHANGES[key]
        for layout in LAYOUTS:
            runs = [run(args, exchange, layout, seed) for seed in args.seeds]
            results.append({"exchange": label, "layout": layout, "runs": runs})
            if hvd.rank() == 0:
                print(f"{label}, {layout}: {summary(results[-1], args)}", flush=True)
    if hvd.rank() == 0:
        print(table(results, args))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))


def summary(result: dict, args) -> dict:
    runs = result["runs"]
    accuracy = [r["accuracy"] for r in runs]
    return {"step": statistics.mean(r["seconds"] / r["steps"] for r in runs),
            "epoch": statistics.mean(r["seconds"] / args.epochs for r in runs),
            "accuracy": statistics.mean(accuracy), "low": min(accuracy), "high": max(accuracy)}


def row(result: dict, args, even: dict) -> str:
    """One table row; ``even``: the summary of the same exchange's even run."""
    mine = summary(result, args)
    return (f"| {result['exchange']} | {result['layout']} | {result['runs'][0]['batches']} | "
            f"{1000 * mine['step']:.1f} | {mine['epoch']:.2f} | "
            f"{mine['epoch'] / even['epoch']:.2f}x | {mine['accuracy']:.4f} | "
            f"{mine['low']:.4f}-{mine['high']:.4f} | "
            f"{100 * (mine['accuracy'] - even['accuracy']):+.2f} |")


def table(results: list[dict], args) -> str:
    head = ("| exchange | batches | batch per rank | ms/step | s/epoch | epoch vs even | "
            "accuracy | range over seeds | points vs even |\n" + "| --- " * 9 + "|")
    rows = []
    for result in results:
        if result["layout"] == "even":
            even = summary(result, args)
        rows.append(row(result, args, even))
    return (f"{hvd.size()} ranks, rank {args.slow_rank} {args.slowdown:g}x slower per sample "
            f"({args.sample_ms:g} ms per sample emulated, {args.slowdown * args.sample_ms:g} "
            f"on it), {args.epochs} epochs, seeds {args.seeds}\n\n{head}\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
