"""Where one training step's time goes, per rank, for one ``--local`` path of benchmark.py.

Why: the benchmark says how far each hvd_sgp path is from its raw MPI reference; this says
which phase the difference is in. It wraps hvd_sgp's functions from outside (hvd_sgp itself is
unchanged) and records, per phase and step, wall time, this thread's CPU time and minor page
faults; rank 0 prints medians, every rank writes JSON with --out. CPU time is the figure to
trust on a shared, loaded machine: wall time there mostly measures who else runs.

    OMPI_MCA_mpi_yield_when_idle=1 HVD_SGP_LOCAL_SIZE=1 PYTHONPATH=. \\
        mpirun -np 2 --oversubscribe --bind-to none python examples/profile_step.py sgp1-gossip
    # the one-node path: leave HVD_SGP_LOCAL_SIZE unset and pass `node`; Horovod: `horovod`
    # with a Python that has it. MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ as in --local.

Phases a checkout lacks are simply absent (hvd_sgp's internals move; adjust the names).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
import benchmark  # noqa: E402

WALL, CPU, FAULTS = defaultdict(float), defaultdict(float), defaultdict(float)


def now() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter(), time.thread_time(), usage.ru_minflt


def record(label: str, start: tuple[float, float, int]) -> None:
    wall, cpu, faults = now()
    WALL[label] += wall - start[0]
    CPU[label] += cpu - start[1]
    FAULTS[label] += faults - start[2]


def timed(owner: type, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that every call adds to phase ``label``."""
    if not hasattr(owner, name):
        return
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = now()
        try:
            return function(*args, **kwargs)
        finally:
            record(label, start)

    setattr(owner, name, wrapper)


def instrument_hvd_sgp() -> None:
    from hvd_sgp.common import arrays, engine, node, pushsum, transport
    from hvd_sgp.torch import flat

    timed(flat.FlatGroup, "gather_grads", "grad gather copy (scaled)")
    timed(flat.FlatGroup, "scatter_grads", "grad scatter copy")
    timed(engine.GossipEngine, "reduce_gradients", "gradient Allreduce")
    timed(engine.GossipEngine, "end_step", "end_step (total)")
    timed(pushsum.PushSumMixer, "begin", "mixer.begin")
    timed(pushsum.PushSumMixer, "add", "mixer.add")
    timed(pushsum.PushSumMixer, "settle", "settle")
    timed(transport.PeerTransport, "wait", "transport.wait")
    timed(transport.Progress, "wait_receives", "progress.wait_receives")
    timed(transport.Progress, "wait_all", "progress.wait_all")
    timed(arrays.NumpyKit, "finite", "NaN check")
    timed(node.NodeShard, "gather", "in-node Allgatherv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", choices=sorted(benchmark.MODES))
    parser.add_argument("--params", type=int, default=25_557_032)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)

    mode = benchmark.MODES[args.path]
    comm = benchmark.Comm(mode, args)
    if mode.kind in ("hvd_sgp", "plain"):
        instrument_hvd_sgp()
    if mode.kind == "raw":
        timed(benchmark.RawExchange, "step", "raw exchange step (total)")
    timed(torch.optim.SGD, "step", "SGD step")

    model = bench_model.make_model(args.params, 256, args.layers)
    model, opt = comm.wrap(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3,
                                                        momentum=0.9))
    x, y = bench_model.synthetic_batch(args.batch, seed=comm.rank)
    set_to_none = os.environ.get("PROFILE_SET_TO_NONE", "1") == "1"
    steps = []
    for i in range(args.warmup + args.steps):
        WALL.clear()
        CPU.clear()
        FAULTS.clear()
        process_start = time.process_time()
        start = now()
        opt.zero_grad(set_to_none=set_to_none)
        logits, penalty = model(x)
        (functional.cross_entropy(logits, y) + penalty).backward()
        record("forward+backward", start)
        stepped = now()
        opt.step()
        record("optimizer.step (total)", stepped)
        record("step", start)
        if i >= args.warmup:
            steps.append({"wall": dict(WALL), "cpu": dict(CPU), "faults": dict(FAULTS),
                          "process_cpu": time.process_time() - process_start})
    comm.close(opt)

    phases = list(dict.fromkeys(k for step in steps for k in step["wall"]))
    medians = {k: [statistics.median(s[m].get(k, 0.0) for s in steps)
                   for m in ("wall", "cpu", "faults")] for k in phases}
    process_cpu = statistics.median(s["process_cpu"] for s in steps)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/rank{comm.rank}.json", "w") as handle:
            json.dump({"rank": comm.rank, "median": medians, "process_cpu": process_cpu,
                       "steps": steps}, handle)
    if comm.rank == 0:
        print(f"== {args.path} n={comm.size} params={args.params} layers={args.layers} "
              f"(rank 0 medians; process CPU/step {process_cpu * 1000:.0f} ms)")
        print(f"  {'phase':28s} {'wall ms':>9s} {'CPU ms':>9s} {'faults':>8s}")
        for label, (wall, cpu, faults) in sorted(medians.items(), key=lambda kv: -kv[1][0]):
            print(f"  {label:28s} {wall * 1000:9.1f} {cpu * 1000:9.1f} {faults:8.0f}")


if __name__ == "__main__":
    main()
