"""SGP against AllReduce, on localhost or on the virtual cluster with shaped links.

Why: SGP's claim is a step time bound by one model per iteration on the slowest link, where
ring AllReduce sends two and waits for everyone. One command measures, per mode and number of
ranks, the median seconds per iteration, the bytes each rank sends per iteration (on the
shaped interfaces when on the virtual cluster), peak memory and its excess over the plain
optimizer, and the ratio to the physical bound max(compute, bytes / link rate); then a
time-to-accuracy run on scikit-learn's digits. Writes JSON, a markdown table and PNG plots.

    python examples/benchmark.py --tiny                                  # localhost, seconds
    sudo python examples/benchmark.py --cluster --rate 1gbit \
        --horovod-python /tmp/hvdvenv/bin/python                         # the full run
    python examples/benchmark.py --local --horovod-python /tmp/hvdvenv/bin/python
                                        # one machine: each path against its raw MPI reference

Every (mode, n) is its own ``mpirun`` of this file with ``--worker``; each rank writes a
JSON file that the driver reads back.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "mpi")]


@dataclass(frozen=True)
class Mode:
    """One way of training: which library wraps the optimizer, and its options."""

    label: str
    kind: str  # plain | hvd_sgp | ddp | horovod | raw (mpi4py alone, see RawExchange)
    sgp: dict = field(default_factory=dict)
    ring: bool = False  # Open MPI's ring allreduce (the virtual cluster only)
    env: dict = field(default_factory=dict)  # launch environment on top (None: unset)
    reference: str = ""  # the raw mode this one is held to (--local)
    set_to_none: bool = True  # the script's zero_grad(set_to_none=...): torch's default

    @property
    def period(self) -> int:
        """Steps between exchanges. Such a mode warms up and is timed for --warmup and --iters
        whole periods, and its step's time is the mean, not the median (which would leave the
        exchanging step out)."""
        return self.sgp.get("local_steps", 1)


MODES = {
    "plain": Mode("local SGD, no communication", "plain"),
    "allreduce": Mode("AllReduce (hvd_sgp, MPI default)", "hvd_sgp", {"mode": "allreduce"}),
    "allreduce-ring": Mode("AllReduce (hvd_sgp, MPI ring)", "hvd_sgp", {"mode": "allreduce"},
                           ring=True),
    "ddp": Mode("AllReduce (torch DDP, gloo)", "ddp"),
    "horovod": Mode("AllReduce (Horovod)", "horovod"),
    "dpsgd": Mode("D-PSGD", "hvd_sgp", {"mode": "dpsgd", "peers": 1}),
    "sgp1": Mode("SGP 1-peer", "hvd_sgp", {"mode": "sgp", "peers": 1}),
    "sgp2": Mode("SGP 2-peer", "hvd_sgp", {"mode": "sgp", "peers": 2}),
    "osgp1": Mode("OSGP tau=1", "hvd_sgp", {"mode": "sgp", "peers": 1, "overlap": True,
                                             "max_delay": 1}),
    "osgp2": Mode("OSGP tau=2", "hvd_sgp", {"mode": "sgp", "peers": 1, "overlap": True,
                                             "max_delay": 2}),
    "sgp1-int8": Mode("SGP 1-peer, int8", "hvd_sgp", {"mode": "sgp", "peers": 1,
                                                       "compression": "int8"}),
    "sgp1-topk1": Mode("SGP 1-peer, top-k 1%", "hvd_sgp", {"mode": "sgp", "peers": 1,
                                                           "compression": "topk:0.01"}),
    "diloco32": Mode("gossip-DiLoCo H=32 (SGP 1-peer, fp32)", "hvd_sgp",
                     {"mode": "sgp", "peers": 1, "local_steps": 32, "outer_optimizer": "diloco"}),
    "diloco32-int4": Mode("gossip-DiLoCo H=32 (SGP 1-peer, int4)", "hvd_sgp",
                          {"mode": "sgp", "peers": 1, "local_steps": 32,
                           "outer_optimizer": "diloco", "compression": "int4"}),
    "odiloco32": Mode("gossip-DiLoCo H=32, fp32, overlapped (tau=8)", "hvd_sgp",
                      {"mode": "sgp", "peers": 1, "local_steps": 32, "outer_optimizer": "diloco",
                       "overlap": True, "max_delay": 8}),
    "odiloco32-int4": Mode("gossip-DiLoCo H=32, int4, overlapped (tau=4)", "hvd_sgp",
                           {"mode": "sgp", "peers": 1, "local_steps": 32,
                            "outer_optimizer": "diloco", "compression": "int4",
                            "overlap": True, "max_delay": 4}),
}
# --local: one machine, shared memory; every hvd_sgp path beside the raw MPI exchange it must
# meet (the launcher makes every rank its own SGP node unless a mode unsets that).
LOCAL_MODES = {
    "plain": MODES["plain"],
    "raw-allreduce": Mode("raw MPI Allreduce + SGD", "raw", {"exchange": "allreduce"}),
    "horovod": Mode("AllReduce (Horovod)", "horovod", reference="raw-allreduce"),
    "node": Mode("hvd_sgp one node (exact, default layout), zero_grad()", "hvd_sgp",
                 env={"HVD_SGP_LOCAL_SIZE": None}, reference="raw-allreduce"),
    "node-zero-kept": Mode("hvd_sgp one node (exact), zero_grad(set_to_none=False)", "hvd_sgp",
                           env={"HVD_SGP_LOCAL_SIZE": None}, reference="raw-allreduce",
                           set_to_none=False),
    "raw-sendrecv": Mode("raw one-peer Sendrecv + average", "raw", {"exchange": "sendrecv"}),
    "sgp1-gossip": Mode("hvd_sgp SGP 1-peer (LOCAL_SIZE=1)", "hvd_sgp",
                        {"mode": "sgp", "peers": 1}, env={"HVD_SGP_LOCAL_SIZE": "1"},
                        reference="raw-sendrecv"),
    "osgp1-gossip": Mode("hvd_sgp OSGP tau=1 (LOCAL_SIZE=1)", "hvd_sgp",
                         {"mode": "sgp", "peers": 1, "overlap": True, "max_delay": 1},
                         env={"HVD_SGP_LOCAL_SIZE": "1"}, reference="raw-sendrecv"),
}
CLUSTER_MODES = list(MODES)
MODES.update(LOCAL_MODES)  # same modes, plus the raw reference they are held to with --local
ALLREDUCES = ("allreduce", "allreduce-ring", "ddp", "horovod", "raw-allreduce")
BASELINE = "@baseline"  # suffix of a mode run against --baseline's hvd_sgp
# glibc malloc that keeps freed memory instead of returning it to the kernel: without it, every
# step of every mode can page-fault in up to ~140 MB per rank (gradients that autograd
# allocates afresh after zero_grad(set_to_none=True), MPI_Allreduce's temporary buffer), and
# which mode faults depends on the order of its frees, not on its work (measured: 0 to 37k
# faults per step for the same work). The --local default, for every row alike.
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def mode_of(name: str, baseline: str = "") -> Mode:
    """The Mode called ``name``; ``<mode>@baseline`` is that mode with another checkout's
    hvd_sgp first on PYTHONPATH (``--baseline``), to measure a change side by side."""
    if not name.endswith(BASELINE):
        return MODES[name]
    base = MODES[name[:-len(BASELINE)]]
    return replace(base, label=base.label + " [baseline]",
                   env={**base.env, "PYTHONPATH": baseline})


# --- the worker: one rank of one (mode, n) ----------------------------------------------
class Comm:
    """The few collectives the worker needs, from whichever library the mode uses."""

    def __init__(self, mode: Mode, args):
        import torch
        self.torch = torch
        self.kind = mode.kind
        if mode.kind == "raw":
            from mpi4py import MPI
            self.mpi, self.world = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        elif mode.kind == "ddp":
            import torch.distributed as dist
            self.dist = dist
            dist.init_process_group(
                "gloo", init_method=f"tcp://{args.master_addr}:{args.port}",
                rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            if mode.kind == "horovod":
                import horovod.torch as hvd
            else:
                import hvd_sgp.torch as hvd
            self.hvd = hvd
            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, mode: Mode, model, optimizer, prefix: str = ""):
        """The distributed model and optimizer, starting from rank 0's parameters."""
        if self.kind == "ddp":
            return self.torch.nn.parallel.DistributedDataParallel(model), optimizer
        if self.kind == "raw":
            for p in model.parameters():
                self.world.Bcast(p.data.numpy(), root=0)
            return model, RawExchange(optimizer, list(model.parameters()), self.world,
                                      mode.sgp["exchange"])
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if self.kind == "plain":
            return model, optimizer
        extra = dict(mode.sgp) if self.kind == "hvd_sgp" else {}
        if "compression" in extra:  # a codec spec, name or name:ARG, as HVD_SGP_COMPRESSION
            name, _, arg = extra["compression"].partition(":")
            chosen = getattr(self.hvd.Compression, name)
            extra["compression"] = chosen(arg) if arg else chosen
        named = [(prefix + name, p) for name, p in model.named_parameters()]
        return model, self.hvd.DistributedOptimizer(optimizer, named_parameters=named, **extra)

    def minimum(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64)
        if self.kind == "raw":
            self.world.Allreduce(self.mpi.IN_PLACE, t.numpy(), op=self.mpi.MIN)
            return t.item()
        if self.kind == "ddp":
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
            return t.item()
        return self.hvd.allreduce(t, op=self.hvd.Min, name="min").item()

    def collective(self) -> None:
        """One small allreduce through the library's Horovod-style API (the idle probe)."""
        t = self.torch.ones(16)
        if self.kind == "raw":
            self.world.Allreduce(self.mpi.IN_PLACE, t.numpy(), op=self.mpi.SUM)
        elif self.kind == "ddp":
            self.dist.all_reduce(t)
        else:
            self.hvd.allreduce(t, name="idle_probe")

    def close(self, optimizer) -> None:
        if hasattr(optimizer, "synchronize_gossip"):
            optimizer.synchronize_gossip()  # no message left in flight at exit
        self.minimum(0.0)  # a barrier
        if self.kind == "ddp":
            self.dist.destroy_process_group()


class RawExchange:
    """The hand-written references of --local, on mpi4py alone: the least work a one-node
    exact path and a one-peer gossip step need, which hvd_sgp's paths are held to.

    ``allreduce``: each fresh gradient is copied into one flat buffer, pre-divided by n in the
    same pass (the one pass that PyTorch's newly allocated gradient tensors need), reduced by
    one in-place MPI_Allreduce, and handed to the optimizer as views of that buffer (no copy
    back). ``sendrecv``: the parameters live as views in one flat buffer (as hvd_sgp's do);
    after the local step the buffer goes to one peer of the one-peer exponential graph (2^(k
    mod m) ahead) while one arrives from the peer as far behind, in one MPI_Sendrecv, and one
    pass averages it in (lerp by 1/2, SGP's uniform mixing with the weight left at 1).
    """

    def __init__(self, optimizer, params: list, comm, exchange: str):
        import torch
        from mpi4py import MPI
        self.torch, self.mpi = torch, MPI
        self.optimizer, self.params, self.comm, self.exchange = optimizer, params, comm, exchange
        self.param_groups = optimizer.param_groups
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        numel = sum(p.numel() for p in params)
        self.nbytes = numel * 4
        self.flat = torch.zeros(numel)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        if exchange == "sendrecv":
            with torch.no_grad():
                for p, view in zip(params, self.views):
                    view.copy_(p.data)
                    p.data = view
            self.received = torch.empty(numel)
        n = self.size
        self.offsets = [2 ** j for j in range(int(math.log2(n - 1)) + 1)] if n > 1 else []
        self.iteration = 0
        self.bytes_sent = 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.exchange == "allreduce":
            with self.torch.no_grad():
                for p, view in zip(self.params, self.views):
                    if p.grad is None:
                        view.zero_()
                    else:
                        self.torch.mul(p.grad, 1.0 / self.size, out=view)
                    p.grad = view
            self.comm.Allreduce(self.mpi.IN_PLACE, self.flat.numpy(), op=self.mpi.SUM)
            self.bytes_sent += 2 * (self.size - 1) / self.size * self.nbytes
            self.optimizer.step()
        else:
            self.optimizer.step()
            if self.offsets:
                ahead = self.offsets[self.iteration % len(self.offsets)]
                self.comm.Sendrecv(self.flat.numpy(), dest=(self.rank + ahead) % self.size,
                                   recvbuf=self.received.numpy(),
                                   source=(self.rank - ahead) % self.size)
                self.flat.lerp_(self.received, 0.5)
                self.bytes_sent += self.nbytes
        self.iteration += 1

    def metrics(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "total_wait_seconds": 0.0}


def idle_probe(comm: Comm, mode: Mode, args) -> dict:
    """CPU a rank blocked on late peers uses, as a fraction of one core (its threads' time on
    a CPU; the time they also waited runnable is kept beside it: a spin that yields to other
    load shows only its share of a busy machine, a sleeping wait far less): every rank but 0
    sleeps ``args.idle_seconds`` before joining (1) two training steps of a tiny model wrapped
    like the measured one (a gossip wait, an in-node allreduce, Horovod's allreduce) and (2)
    one small allreduce through the library's own API (a Horovod-API collective)."""
    import bench_model as bm
    import torch
    result = {}
    model = bm.PayloadMLP(2000, hidden=8)
    model, optimizer = comm.wrap(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                 prefix="idle.")
    x, y = bm.synthetic_batch(8, seed=comm.rank)
    for _ in range(3):
        bm.train_step(model, optimizer, x, y)
    probes = [("collective", comm.collective)]
    if mode.kind != "plain":
        probes.insert(0, ("step", lambda: [bm.train_step(model, optimizer, x, y)
                                           for _ in range(2)]))
    for name, probe in probes:
        comm.minimum(0.0)
        if comm.rank != 0:
            time.sleep(args.idle_seconds)
        (run, waited), wall = bm.scheduler_seconds(), time.perf_counter()
        probe()
        wall = time.perf_counter() - wall
        run, waited = (now - then for now, then in zip(bm.scheduler_seconds(), (run, waited)))
        result[name] = {"wall": wall, "ran": run, "runnable": run + waited,
                        "core_fraction": run / wall}
    comm.close(optimizer)
    return result


def throughput(comm: Comm, mode: Mode, args) -> dict:
    """Warm-up, then time ``args.iters`` exchanges (steps, or periods of H steps) of the
    payload model on a fixed batch."""
    import bench_model as bm
    import torch
    model = bm.make_model(args.params, args.hidden, args.layers)
    model, optimizer = comm.wrap(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3,
                                                                momentum=0.9))
    x, y = bm.synthetic_batch(args.batch, seed=comm.rank)
    extra = args.compute_ms / 1000
    iters = args.iters * mode.period
    for _ in range(args.warmup * mode.period):
        bm.train_step(model, optimizer, x, y, extra, mode.set_to_none)
    comm.minimum(0.0)
    tx0 = bm.tx_bytes(args.iface) if args.iface else None
    sent0 = optimizer.metrics()["bytes_sent"] if hasattr(optimizer, "metrics") else None
    codec0 = optimizer.metrics().get("codec_seconds", 0.0) if sent0 is not None else 0.0
    times = []
    cpu = time.process_time()
    for _ in range(iters):
        began = time.perf_counter()
        bm.train_step(model, optimizer, x, y, extra, mode.set_to_none)
        times.append(time.perf_counter() - began)
    cpu = time.process_time() - cpu
    result = {"times": times, "median": statistics.median(times),
              "step": (statistics.median(times) if mode.period == 1
                       else statistics.fmean(times)),
              "cpu_per_iter": cpu / iters,
              "model_bytes": _unwrap(model).nbytes(), "peak_rss": bm.peak_rss_bytes()}
    if tx0 is not None:
        result["tx_per_iter"] = (bm.tx_bytes(args.iface) - tx0) / iters
    if sent0 is not None:
        metrics = optimizer.metrics()
        result["sent_per_iter"] = (metrics["bytes_sent"] - sent0) / iters
        result["wait_seconds"] = metrics["total_wait_seconds"]
        result["codec_seconds_per_iter"] = (metrics.get("codec_seconds", 0.0)
                                            - codec0) / iters
    comm.close(optimizer)
    if args.idle_seconds > 0:
        result["idle"] = idle_probe(comm, mode, args)
    return result


def time_to_accuracy(comm: Comm, mode: Mode, args) -> dict:
    """Train on this rank's shard of digits until every rank's model reaches the target."""
    import bench_model as bm
    import torch
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = bm.digits_split()
    x_train, y_train = x_train[comm.rank::comm.size], y_train[comm.rank::comm.size]
    model = bm.PayloadMLP(args.tta_params, hidden=64)
    model, optimizer = comm.wrap(mode, model, torch.optim.SGD(model.parameters(), lr=args.lr,
                                                                momentum=0.9))
    net = _unwrap(model).net
    curve, step, reached = [], 0, False
    comm.minimum(0.0)
    start = time.perf_counter()
    for epoch in range(args.max_epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(order) - args.tta_batch + 1, args.tta_batch):
            batch = order[i:i + args.tta_batch]
            bm.train_step(model, optimizer, x_train[batch], y_train[batch])
            step += 1
            if step % args.eval_every == 0:
                acc = bm.accuracy(net, x_test, y_test)
                curve.append((time.perf_counter() - start, step, acc))
                reached = comm.minimum(acc) >= args.target
                if reached:
                    break
        if reached:
            break
    comm.close(optimizer)
    return {"curve": curve, "reached": reached, "steps": step}


def _unwrap(model):
    return getattr(model, "module", model)


def worker(args) -> None:
    import torch
    torch.set_num_threads(1)
    mode = mode_of(args.worker)
    comm = Comm(mode, args)
    run = throughput if args.task == "throughput" else time_to_accuracy
    result = run(comm, mode, args)
    result.update(rank=comm.rank, host=os.uname().nodename)
    Path(args.out, f"rank{comm.rank}.json").write_text(json.dumps(result))


# --- the driver ---------------------------------------------------------------------------
WORKER_ARGS = ("params", "hidden", "layers", "idle_seconds", "batch", "compute_ms", "warmup", "iters", "tta_params",
               "tta_batch", "lr", "target", "max_epochs", "eval_every", "seed")


@dataclass
class Launcher:
    """Builds the ``mpirun`` line of one run, on localhost or inside the virtual cluster."""

    cluster: object = None  # a virtual_cluster.Cluster
    horovod_python: str = ""
    port: int = 29400
    baseline: str = ""  # another checkout's root, for the <mode>@baseline runs
    env: dict = field(default_factory=dict)  # on top of the launch environment, every mode

    def python(self, mode: Mode) -> str:
        return self.horovod_python if mode.kind == "horovod" else sys.executable

    def command(self, mode: Mode, n: int, worker: list[str]) -> tuple[list[str], dict]:
        import virtual_cluster as vc
        python = self.python(mode)
        mpirun = str(Path(python).parent / "mpirun")
        env = vc.run_env(Path(python).parent)
        if self.cluster is None:
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"
            cmd = [mpirun, "-np", str(n), "--oversubscribe", "--bind-to", "none"]
        else:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            cmd = vc.launch_prefix(self.cluster) + vc.mpirun_command(self.cluster, n, mpirun,
                                                                    ring=mode.ring)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        env.update(self.env)
        for key, value in mode.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return cmd + [python, str(Path(__file__).resolve()), *worker], env

    def run(self, task: str, name: str, n: int, args) -> list[dict]:
        """One mpirun; returns every rank's result (raises with the output on failure)."""
        mode = mode_of(name, self.baseline)
        self.port += 1
        master = self.cluster.address(0) if self.cluster is not None else "127.0.0.1"
        with tempfile.TemporaryDirectory(prefix="hvd_sgp_bench_") as out:
            worker = ["--worker", name, "--task", task, "--out", out, "--master-addr", master,
                      "--port", str(self.port)]
            worker += [f"--{a.replace('_', '-')}={getattr(args, a)}" for a in WORKER_ARGS]
            if self.cluster is not None:
                worker.append("--iface=eth0")
            cmd, env = self.command(mode, n, worker)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.launch_timeout, check=False)
            files = sorted(Path(out).glob("rank*.json"))
            if proc.returncode != 0 or len(files) != n:
                raise RuntimeError(f"{name} on {n} ranks exited {proc.returncode}:\n"
                                   f"{shlex.join(cmd)}\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            return [json.loads(f.read_text()) for f in files]


def horovod_usable(python: str) -> bool:
    if not python:
        return False
    probe = subprocess.run([python, "-c", "import horovod.torch"], capture_output=True,
                           check=False)
    return probe.returncode == 0


def _step(ranks: list[dict]) -> float:
    """One launch's seconds per step: the slowest rank's median (mean over whole periods
    where a mode exchanges every H steps)."""
    return max(r["step"] for r in ranks)


def _utilisation(ranks: list[dict]) -> float:
    """Compute / wall of a mode that exchanges every H steps, within its own launch: a local
    step's time (the median step) over the mean step, the slowest rank's."""
    return min(statistics.median(r["times"]) / statistics.fmean(r["times"]) for r in ranks)


def _profile(ranks: list[dict], period: int) -> list[float]:
    """Where a period's time goes: the slowest rank's mean seconds at each step of the
    period (step H is the sync; under overlap its outer step lands tau steps later)."""
    slowest = max(ranks, key=lambda r: statistics.fmean(r["times"]))
    return [statistics.fmean(slowest["times"][k::period]) for k in range(period)]


def _paired(launches: list, against: list) -> dict:
    """Ratios of seconds per step, launch by launch (launch i of every mode ran in the same
    round, so they saw about the same load): median and range."""
    ratios = [_step(a) / _step(b) for a, b in zip(launches, against)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summarize_throughput(raw: dict, link_rate: float | None) -> list[dict]:
    """Per (n, mode), over its launches (``raw[(mode, n)]`` is a list of launches, each a list
    of rank results): the median over launches of the slowest rank's median step and their
    range, bytes, memory, CPU, bound and ratios."""
    rows = []
    for n in sorted({key[1] for key in raw}):
        plain = raw.get(("plain", n))
        compute = statistics.median(_step(l) for l in plain) if plain else 0.0
        base_rss = max(r["peak_rss"] for l in plain for r in l) if plain else None
        reference = raw.get(("allreduce", n))
        gossip = raw.get(("sgp1", n))
        for name, m in [k for k in raw if k[1] == n]:
            launches = raw[(name, m)]
            ranks = launches[0]
            model_bytes = ranks[0]["model_bytes"]
            secs = [_step(l) for l in launches]
            sec = statistics.median(secs)
            if "tx_per_iter" in ranks[0]:
                sent, source = max(r["tx_per_iter"] for r in ranks), "interface"
            elif name in ALLREDUCES:
                sent, source = 2 * (n - 1) / n * model_bytes, "ring estimate"
            else:
                sent, source = max(r.get("sent_per_iter", 0.0) for r in ranks), "metrics"
            bound = max(compute, sent / link_rate if link_rate else 0.0)
            peak = max(r["peak_rss"] for l in launches for r in l)
            row = {"n": n, "mode": name, "label": mode_of(name).label, "sec_per_iter": sec,
                   "sec_min": min(secs), "sec_max": max(secs), "launch_secs": secs,
                   "bytes_per_iter": sent, "bytes_source": source, "peak_rss": peak,
                   "model_bytes": model_bytes, "compute_sec": compute, "bound_sec": bound,
                   "ratio_to_bound": sec / bound if bound else None}
            if "cpu_per_iter" in ranks[0]:
                row["cpu_per_iter"] = statistics.median(
                    max(r["cpu_per_iter"] for r in l) for l in launches)
            if "idle" in ranks[0]:  # rank 0 is the one that waited; the worst launch
                row["idle"] = {probe: max(next(r for r in l if r["rank"] == 0)["idle"][probe]
                                          ["core_fraction"] for l in launches)
                               for probe in ranks[0]["idle"]}
            if base_rss is not None and name != "plain":
                row["extra_model_copies"] = (peak - base_rss) / model_bytes
            if reference and name != "plain":
                row["vs_allreduce"] = sec / statistics.median(_step(l) for l in reference)
            if gossip and name != "plain":
                row["vs_sgp1"] = sec / statistics.median(_step(l) for l in gossip)
            if mode_of(name).period > 1:
                row["utilisation"] = statistics.median(_utilisation(l) for l in launches)
                row["period_profile"] = _profile(launches[0], mode_of(name).period)
            codec = [r["codec_seconds_per_iter"] for r in ranks if "codec_seconds_per_iter" in r]
            if codec and max(codec) > 0:
                row["codec_sec_per_iter"] = max(codec)
            ref = mode_of(name).reference
            if (name + BASELINE, n) in raw:
                row["vs_baseline"] = _paired(launches, raw[(name + BASELINE, n)])
            if ref and (ref, n) in raw:
                row["reference"], row["vs_reference"] = ref, _paired(launches, raw[(ref, n)])
            if ref == "raw-allreduce" and name != "horovod" and ("horovod", n) in raw:
                row["vs_horovod"] = _paired(launches, raw[("horovod", n)])
            rows.append(row)
    return rows


def summarize_tta(raw: dict, target: float) -> list[dict]:
    """Per mode: the wall time at which every rank first had the target test accuracy."""
    rows = []
    for (name, n), ranks in raw.items():
        points = [(max(r["curve"][k][0] for r in ranks), ranks[0]["curve"][k][1],
                   min(r["curve"][k][2] for r in ranks))
                  for k in range(min(len(r["curve"]) for r in ranks))]
        hit = next((p for p in points if p[2] >= target), None)
        rows.append({"mode": name, "label": mode_of(name).label, "n": n, "curve": points,
                     "seconds_to_target": hit[0] if hit else None,
                     "steps_to_target": hit[1] if hit else None,
                     "final_min_accuracy": points[-1][2] if points else None})
    return rows


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _ratio(r: dict | None) -> str:
    return "—" if r is None else f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})"


def markdown_local(report: dict) -> str:
    """The --local table: every path beside its raw MPI reference on one machine."""
    setting = (f"Setting: {report['setting']}; model {report['model']}, "
               f"{report['params'] / 1e6:.1f}M parameters ({report['params'] * 4 / 1e6:.0f} MB), "
               f"batch {report['batch']}, {report['warmup']} warm-up + {report['iters']} measured "
               f"steps per launch, {report['repeats']} launches per row (interleaved); machine "
               f"load at the start {report['load']}.")
    lines = [f"Command: `{report['command']}`", "", setting, "",
             "| n | path | s/step | range | vs raw ref (range) | vs Horovod (range) | "
             "vs baseline (range) | CPU s/step | peak RSS MB | extra model copies | "
             "blocked rank: % of a core (step / collective) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        idle = r.get("idle", {})
        blocked = " / ".join(_fmt(100 * idle[p], ".0f") if p in idle else "—"
                             for p in ("step", "collective"))
        ref = f"{_ratio(r.get('vs_reference'))} to {r['reference']}" if "reference" in r else "—"
        lines.append(
            f"| {r['n']} | {r['label']} | {r['sec_per_iter']:.3f} | "
            f"{r['sec_min']:.3f}–{r['sec_max']:.3f} | {ref} | {_ratio(r.get('vs_horovod'))} | "
            f"{_ratio(r.get('vs_baseline'))} | "
            f"{_fmt(r.get('cpu_per_iter'), '.3f')} | {r['peak_rss'] / 1e6:.0f} | "
            f"{_fmt(r.get('extra_model_copies'), '.2f')} | {blocked} |")
    if report["skipped_modes"]:
        lines += ["", "Not run: " + ", ".join(report["skipped_modes"]) +
                  " (no usable --horovod-python)"]
    if report["failures"]:
        lines += ["", "Failed runs: " + "; ".join(report["failures"])]
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    """The tables of docs/benchmark.md."""
    setting = (f"Setting: {report['setting']}; model {report['params'] / 1e6:.1f}M parameters "
               f"({report['params'] * 4 / 1e6:.0f} MB), {report['warmup']} warm-up + "
               f"{report['iters']} measured exchanges (steps; whole periods of H steps for a mode "
               f"that exchanges every H, its s/iter their mean; its compute / wall: the median "
               f"step, a local one, over the mean), extra compute {report['compute_ms']} ms/step.")
    header = ("| n | mode | s/iter | vs AllReduce | vs fp32 SGP | compute / wall | "
              "MB sent/rank/iter | CPU s/rank/iter | bound s | ratio to bound | peak RSS MB | "
              "extra model copies |")
    lines = [f"Command: `{report['command']}`", "", setting, "", header,
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        lines.append(
            f"| {r['n']} | {r['label']} | {r['sec_per_iter']:.3f} | "
            f"{_fmt(r.get('vs_allreduce'), '.2f')} | {_fmt(r.get('vs_sgp1'), '.2f')} | "
            f"{_fmt(r.get('utilisation'), '.0%')} | {r['bytes_per_iter'] / 1e6:.1f}"
            f"{'' if r['bytes_source'] == 'interface' else ' (' + r['bytes_source'] + ')'} | "
            f"{_fmt(r.get('cpu_per_iter'), '.3f')} | {r['bound_sec']:.3f} | "
            f"{_fmt(r['ratio_to_bound'], '.2f')} | "
            f"{r['peak_rss'] / 1e6:.0f} | {_fmt(r.get('extra_model_copies'), '.2f')} |")
    if report["tta"]:
        title = (f"Time to accuracy on digits ({report['tta_params'] / 1e6:.1f}M-parameter "
                 f"model, target {report['target']:.2f} on every rank):")
        lines += ["", title, "", "| n | mode | seconds | steps | final min accuracy |",
                  "|---|---|---|---|---|"]
        for r in report["tta"]:
            lines.append(f"| {r['n']} | {r['label']} | {_fmt(r['seconds_to_target'], '.1f')} | "
                         f"{_fmt(r['steps_to_target'], 'd')} | "
                         f"{_fmt(r['final_min_accuracy'], '.3f')} |")
    if report["failures"]:
        lines += ["", "Failed runs: " + "; ".join(report["failures"])]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, text: str, marker: str = "results") -> None:
    """Replace the text between the result markers, keeping any hand-written analysis."""
    start, end = f"<!-- {marker} start -->", f"<!-- {marker} end -->"
    old = path.read_text() if path.exists() else f"# Benchmark\n\n{start}\n{end}\n"
    if start not in old or end not in old:
        old = old.rstrip("\n") + f"\n\n{start}\n{end}\n"
    head, rest = old.split(start, 1)
    path.write_text(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")


def plot(report: dict, sec_png: Path, tta_png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, mode in MODES.items():
        rows = [r for r in report["throughput"] if r["mode"] == name]
        if rows:
            ax.plot([r["n"] for r in rows], [r["sec_per_iter"] for r in rows], marker="o",
                    label=mode.label, linestyle="--" if name in ALLREDUCES else "-")
    ax.set(xlabel="ranks (n)", ylabel="seconds per iteration (median)",
           title=f"{report['params'] / 1e6:.1f}M parameters, {report['setting']}")
    ax.set_xticks(report["ns"], [str(n) for n in report["ns"]])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(sec_png, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["tta"]:
        ax.plot([p[0] for p in r["curve"]], [p[2] for p in r["curve"]], marker=".",
                label=f"{r['label']} (n={r['n']})")
    ax.axhline(report["target"], color="grey", linewidth=0.8)
    ax.set(xlabel="wall seconds", ylabel="lowest test accuracy over ranks",
           title=f"digits, {report['setting']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(tta_png, dpi=110)
    plt.close(fig)


def plan(args, modes: list[str]) -> list[tuple[str, str, int]]:
    """Every (task, mode, n) to launch; ``--repeats`` rounds of the throughput runs, each round
    every mode once, so that paired ratios compare launches that saw the same load."""
    runs = [("throughput", m, n) for _ in range(args.repeats)
            for n in sorted(args.ns, reverse=True) for m in modes]
    return runs + [("tta", m, args.tta_n) for m in args.tta_modes]


def drive(args) -> dict:
    import virtual_cluster as vc
    from tqdm import tqdm
    modes = [m for m in args.modes if m != "horovod" or horovod_usable(args.horovod_python)]
    if args.cluster is None:
        modes = [m for m in modes if not MODES[m].ring]
    if args.baseline:  # each hvd_sgp mode twice in every round: this checkout, then the other
        modes = [twin for m in modes for twin in
                 ([m, m + BASELINE] if MODES[m].kind == "hvd_sgp" else [m])]
    skipped = sorted(set(args.modes) - set(modes))
    cluster = None
    if args.cluster is not None:
        hosts = max(args.ns + [args.tta_n])
        cluster = vc.up(vc.Cluster(args.cluster, hosts, args.subnet, args.rate, args.delay))
    raw = {"throughput": {}, "tta": {}}
    failures = []
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    launcher = Launcher(cluster, args.horovod_python, baseline=args.baseline,
                        env=MALLOC_KEEP if args.malloc == "keep" else {})
    try:
        runs = plan(args, modes)
        with tqdm(runs, desc="benchmark", unit="run") as bar:
            for task, name, n in bar:
                bar.set_postfix_str(f"{task} {name} n={n}")
                try:
                    ranks = launcher.run(task, name, n, args)
                    if task == "tta":
                        raw[task][(name, n)] = ranks
                    else:
                        raw[task].setdefault((name, n), []).append(ranks)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    failures.append(f"{task} {name} n={n}")
                    tqdm.write(f"FAILED {task} {name} n={n}: {error}", file=sys.stderr)
    finally:
        if cluster is not None:
            vc.down(cluster.prefix)
    link_rate = vc.rate_bytes_per_second(args.rate) if cluster is not None else None
    setting = (f"virtual cluster, {args.rate} links" +
               (f", delay {args.delay} " + ("emulated" if cluster.delay_emulated else
                                            "NOT emulated (no netem)") if args.delay else "")
               if cluster is not None else "localhost (shared memory)")
    if args.local:
        setting = (f"one machine, {os.cpu_count()} cores, shared memory (Open MPI sm BTL, "
                   "mpi_yield_when_idle=1), glibc malloc "
                   + ("keeping freed memory (" + ", ".join(f"{k}={v}" for k, v in
                                                         MALLOC_KEEP.items()) + ")"
                      if args.malloc == "keep" else "defaults"))
    model = (f"{args.layers} Linear layers" if args.layers else
             f"MLP (hidden {args.hidden}) + one payload parameter")
    return {"command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
            "local": args.local, "model": model, "batch": args.batch, "layers": args.layers,
            "repeats": args.repeats, "load": load,
            "setting": setting, "ns": sorted(args.ns), "params": args.params,
            "tta_params": args.tta_params, "target": args.target, "warmup": args.warmup,
            "iters": args.iters, "compute_ms": args.compute_ms, "skipped_modes": skipped,
            "failures": failures, "throughput": summarize_throughput(raw["throughput"], link_rate),
            "tta": summarize_tta(raw["tta"], args.target)}


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", nargs="?", const="sgpbench", default=None, metavar="PREFIX",
                   help="build a virtual cluster (root) named PREFIX for the run")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--delay", default="", help="link delay (ignored without netem)")
    p.add_argument("--subnet", default="10.77.0.0/24")
    p.add_argument("--ns", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--local", action="store_true",
                   help="one machine: each hvd_sgp path beside its raw MPI reference "
                        f"({', '.join(LOCAL_MODES)}), the issue's 16-layer model, batch 8")
    p.add_argument("--modes", nargs="*", default=None, choices=list(MODES),
                   help="default: every cluster mode, or with --local every local mode")
    p.add_argument("--malloc", choices=["default", "keep"], default=None,
                   help="keep: every rank's glibc malloc keeps freed memory (no page faults "
                        "from re-allocated gradients and MPI temporaries; default with --local)")
    p.add_argument("--repeats", type=int, default=None,
                   help="launches per (mode, n), interleaved (default 1, with --local 3)")
    p.add_argument("--layers", type=int, default=None,
                   help="a DeepMLP of this many Linear layers instead of the payload MLP "
                        "(default 0, with --local 16)")
    p.add_argument("--idle-seconds", type=float, default=None,
                   help="after the timed steps, rank 0 waits this long for late peers and its "
                        "CPU use is reported (default 0: off, with --local 1)")
    p.add_argument("--params", type=int, default=25_557_032, help="model size (ResNet-50)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="default 64, with --local 8")
    p.add_argument("--compute-ms", type=float, default=0.0, help="extra compute per step")
    p.add_argument("--warmup", type=int, default=3, help="warm-up exchanges: steps, or periods "
                   "of H steps for a mode that exchanges every H (diloco32)")
    p.add_argument("--iters", type=int, default=None, help="measured exchanges, as --warmup "
                   "(default 10, with --local 8)")
    p.add_argument("--tta-modes", nargs="*", default=["allreduce", "dpsgd", "sgp1", "osgp1"],
                   choices=list(MODES))
    p.add_argument("--tta-n", type=int, default=8)
    p.add_argument("--tta-params", type=int, default=1_000_000)
    p.add_argument("--tta-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target", type=float, default=0.92)
    p.add_argument("--max-epochs", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horovod-python", default="", help="a Python with horovod.torch")
    p.add_argument("--baseline", default="", metavar="CHECKOUT",
                   help="also run every hvd_sgp mode with this checkout's hvd_sgp (e.g. a git "
                        "worktree of main), side by side, with paired ratios to it")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--out", default=None,
                   help="default docs/benchmark.json, with --local docs/benchmark_local.json")
    p.add_argument("--markdown", default=str(REPO / "docs" / "benchmark.md"))
    p.add_argument("--plots", default=str(REPO / "docs"), help="directory for the PNGs")
    p.add_argument("--tiny", action="store_true", help="seconds: 2 ranks, 3 modes, small model")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--task", choices=["throughput", "tta"], help=argparse.SUPPRESS)
    p.add_argument("--master-addr", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    local = args.local
    defaults = {"modes": list(LOCAL_MODES) if local else CLUSTER_MODES,
                "repeats": 3 if local else 1, "layers": 16 if local else 0,
                "idle_seconds": 1.0 if local else 0.0, "batch": 8 if local else 64,
                "iters": 8 if local else 10, "malloc": "keep" if local else "default",
                "out": str(REPO / "docs" / ("benchmark_local.json" if local else
                                            "benchmark.json"))}
    given_modes = args.modes is not None
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if local:
        args.tta_modes = []
    if args.tiny:
        args.ns, args.tta_n, args.params, args.tta_params = [2], 2, 200_000, 20_000
        args.warmup, args.iters, args.max_epochs = 1, 3, 1
        args.repeats = 1
        if local:
            args.layers, args.idle_seconds = min(args.layers, 4), min(args.idle_seconds, 0.3)
        elif not given_modes:
            args.modes = ["plain", "allreduce", "sgp1"]
        args.tta_modes = [m for m in args.tta_modes if m in ("allreduce", "osgp1")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    report = drive(args)
    for path in (Path(args.out).parent, Path(args.markdown).parent, Path(args.plots)):
        path.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.local:  # its own table in the same document, no plots
        write_markdown(Path(args.markdown), markdown_local(report), "local results")
        print(markdown_local(report))
        return 1 if report["failures"] else 0
    write_markdown(Path(args.markdown), markdown(report))
    plot(report, Path(args.plots) / "bench_sec_per_iter.png",
         Path(args.plots) / "bench_time_to_accuracy.png")
    print(markdown(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
