"""Where one training step's time goes, per rank, for one --local path of benchmark.py.

Why: the benchmark says how far each hvd_sgp path is from its raw MPI reference; this says
which phase the difference is in. It wraps hvd_sgp's functions from outside (hvd_sgp itself is
unchanged) and records, per phase and step, wall time, this thread's CPU time and minor page
faults; rank 0 prints medians, every rank writes JSON. CPU time is the figure to trust on a
shared, loaded machine: wall time there mostly measures who else runs.

    OMPI_MCA_mpi_yield_when_idle=1 HVD_SGP_LOCAL_SIZE=1 PYTHONPATH=. \
        mpirun -np 2 --oversubscribe --bind-to none python examples/profile_step.py sgp1-gossip
    # the one-node path: leave HVD_SGP_LOCAL_SIZE unset and pass `node`; Horovod: `horovod`
    # with a Python that has it. MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ as in --local.

Phases that a checkout lacks are simply absent (hvd_sgp's internals move; adjust the names).
"""
import argparse, json, os, statistics, sys, time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
p = argparse.ArgumentParser()
p.add_argument("path")
p.add_argument("--params", type=int, default=25_557_032)
p.add_argument("--layers", type=int, default=16)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--out", default="")
args = p.parse_args()

import torch
torch.set_num_threads(1)
import bench_model as bm
import benchmark as B

import resource
T = defaultdict(float)   # wall
C = defaultdict(float)   # this thread's CPU
F = defaultdict(float)   # minor page faults (this thread)
def _now():
    return time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
def _add(label, start):
    w, c, f = _now()
    T[label] += w - start[0]; C[label] += c - start[1]; F[label] += f - start[2]
def timed(owner, name, label):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        start = _now()
        try:
            return fn(*a, **k)
        finally:
            _add(label, start)
    setattr(owner, name, wrapper)

mode = B.MODES[args.path]
comm = B.Comm(mode, args)
if mode.kind == "hvd_sgp" or mode.kind == "plain":
    import hvd_sgp
    from hvd_sgp.common import engine, pushsum, transport, arrays
    from hvd_sgp.torch import flat
    from hvd_sgp.common.mpi import MPI
    timed(flat.FlatGroup, "gather_grads", "grad gather copy")
    timed(flat.FlatGroup, "scatter_grads", "grad scatter copy")
    if hasattr(flat.FlatGroup, "adopt_grads"):
        timed(flat.FlatGroup, "adopt_grads", "grad adopt (views)")
    def average_in_node(array, local, prescaled=False):
        if local.Get_size() > 1:
            arrays.kit_for(array).ready(array)
            t = _now(); local.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM); _add("in-node Allreduce", t)
            if not prescaled:
                t = _now(); array /= local.Get_size(); _add("grad divide", t)
    engine.average_in_node = average_in_node
    timed(engine.GossipEngine, "communicate", "communicate (total)")
    timed(pushsum.PushSumMixer, "begin", "mixer.begin")
    timed(transport.PeerTransport, "wait", "transport.wait")
    timed(transport.Progress, "wait_receives", "progress.wait_receives")
    timed(transport.Progress, "wait_all", "progress.wait_all")
    timed(pushsum.PushSumMixer, "add", "mixer.add")
    timed(arrays.NumpyKit, "total", "NaN check (float64 sum)")
    if hasattr(arrays.NumpyKit, "finite"):
        timed(arrays.NumpyKit, "finite", "NaN check (finite)")
    timed(pushsum.NodeShard, "gather", "in-node Allgatherv")
    timed(pushsum.PushSumMixer, "settle", "settle")
if mode.kind == "raw":
    timed(B.RawExchange, "step", "raw exchange step (total)")
timed(torch.optim.SGD, "step", "SGD step")

model = bm.make_model(args.params, 256, args.layers)
model, opt = comm.wrap(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
x, y = bm.synthetic_batch(args.batch, seed=comm.rank)
steps = []
import torch.nn.functional as Fn
pcpu = []
for i in range(args.warmup + args.steps):
    T.clear(); C.clear(); F.clear()
    comm.minimum(0.0) if os.environ.get("PROFILE_BARRIER") else None
    p0 = time.process_time()
    t0 = _now()
    opt.zero_grad(set_to_none=os.environ.get("PROFILE_SET_TO_NONE", "1") == "1")
    logits, pen = model(x)
    (Fn.cross_entropy(logits, y) + pen).backward()
    _add("fwd+bwd", t0)
    t1 = _now()
    opt.step()
    _add("optimizer.step (total)", t1)
    _add("step", t0)
    if i >= args.warmup:
        steps.append({"wall": dict(T), "cpu": dict(C), "faults": dict(F), "process_cpu": time.process_time() - p0})
comm.close(opt)
keys = list(dict.fromkeys(k for st in steps for k in st["wall"]))
med = {k: [statistics.median(s[m].get(k, 0.0) for s in steps) for m in ("wall", "cpu", "faults")] for k in keys}
pc = statistics.median(s["process_cpu"] for s in steps)
if args.out:
    os.makedirs(args.out, exist_ok=True)
    json.dump({"rank": comm.rank, "median": med, "process_cpu": pc, "steps": steps}, open(f"{args.out}/rank{comm.rank}.json", "w"))
if comm.rank == 0:
    print(f"== {args.path} hvd_sgp={os.path.dirname(os.path.dirname(sys.modules['hvd_sgp'].__file__)) if 'hvd_sgp' in sys.modules else '-'} n={comm.size} params={args.params} layers={args.layers}  (rank 0 medians; process CPU/step {pc*1000:.0f} ms)")
    print(f"  {'phase':28s} {'wall ms':>9s} {'CPU ms':>9s} {'faults':>8s}")
    for k, v in sorted(med.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:28s} {v[0]*1000:9.1f} {v[1]*1000:9.1f} {v[2]:8.0f}")
