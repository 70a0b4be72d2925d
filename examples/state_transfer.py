"""How fast a replacement's state arrives from a survivor: ``hvd.elastic``'s ``state.sync()``
timed against the link and against MPI's own broadcast of the same bytes.

Why: after a repair that spawned a rank, ``hvd.elastic.run`` calls ``state.sync()`` on every
rank, and the newcomer gets rank 0's model (a tensor broadcast) and optimizer state (a pickled
state_dict through ``broadcast_object``). Its cost is on every survivor's path, so it should
move bytes at about the rate the link and MPI allow, not at Python's.

Rank 0 plays a survivor (one SGD-with-momentum step taken, so the momentum buffers exist) and
the last rank a newcomer (other weights, no momentum). Each repeat resets the newcomer, then
times, on the slowest rank: ``state.sync()``; its parts (``broadcast_parameters`` of the model,
``broadcast_optimizer_state``); an ``MPI.Bcast`` of the same bytes from rank 0 (MPI's rate on
this layout); and a ``Send`` of them from rank 0 to the newcomer alone (the link's). After each
sync every rank's parameters and momentum must equal rank 0's, bit for bit.

    sudo python mpi/virtual_cluster.py up --hosts 8 --rate 1gbit --detach
    sudo python mpi/virtual_cluster.py run -np 2 -- python examples/state_transfer.py --rate 1gbit
    sudo python mpi/virtual_cluster.py run -np 8 -- python examples/state_transfer.py --rate 1gbit
    sgprun -np 2 --local-size 1 python examples/state_transfer.py --parameters 1000000  # loopback
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "mpi")]
import hvd_sgp.torch as hvd  # noqa: E402
from bench_model import RESNET50_PARAMETERS, PayloadMLP  # noqa: E402
from virtual_cluster import rate_bytes_per_second  # noqa: E402


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The parameters' and momentum buffers' bytes, hashed: equal states, equal digests."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        h.update(b"-" if buf is None else buf.numpy().tobytes())
    return h.hexdigest()


def slowest(seconds: float) -> float:
    return MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)


def timed(fn) -> float:
    MPI.COMM_WORLD.Barrier()
    began = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parameters", type=int, default=RESNET50_PARAMETERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="", help="the links' tc rate, for the ratio")
    parser.add_argument("--json", default="", help="append the figures here as one line")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    comm, me, n = MPI.COMM_WORLD, hvd.rank(), hvd.size()
    newcomer = n - 1
    if n < 2:
        raise SystemExit("state_transfer needs 2 ranks or more (a survivor and a newcomer)")
    model = PayloadMLP(args.parameters)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    logits, penalty = model(x)
    (torch.nn.functional.cross_entropy(logits, y) + penalty).backward()
    optimizer.step()  # every rank: momentum buffers exist, gossip has run once
    state = hvd.elastic.TorchState(model, optimizer, epoch=3, step=40)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = 2 * model_bytes  # parameters and one momentum buffer each
    buffer = np.zeros(state_bytes // 4, np.float32)
    figures = {"sync": [], "parameters": [], "optimizer": [], "bcast": [], "send": []}
    for repeat in range(args.repeats):
        if me == newcomer:  # a fresh process: its own initial weights, no optimizer state
            torch.manual_seed(1000 + repeat)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn_like(p))
            optimizer.state.clear()
            state.epoch, state.step = 0, 0
        figures["sync"].append(timed(state.sync))
        digests = comm.allgather(digest(model, optimizer))
        if len(set(digests)) != 1 or (state.epoch, state.step) != (3, 40):
            raise SystemExit(f"rank {me}: after state.sync() the ranks' states differ: "
                             f"{digests}, epoch/step {(state.epoch, state.step)}")
        figures["parameters"].append(timed(
            lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0)))
        figures["optimizer"].append(timed(
            lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0)))
        figures["bcast"].append(timed(lambda: comm.Bcast(buffer, root=0)))
        figures["send"].append(timed(
            lambda: comm.Send(buffer, dest=newcomer) if me == 0 else
            comm.Recv(buffer, source=0) if me == newcomer else None))
    if me != 0:
        return
    median = {k: statistics.median(v) for k, v in figures.items()}
    mb = state_bytes / 1e6
    report = {"ranks": n, "parameters": args.parameters, "state_mb": round(mb, 1),
              "rate": args.rate, "repeats": args.repeats,
              "seconds": {k: [round(s, 3) for s in v] for k, v in figures.items()},
              "mb_per_s": {k: round(mb / s, 1) for k, s in median.items()
                           if k in ("sync", "bcast", "send")}}
    print(f"{n} ranks, {args.parameters:,} parameters: state (model + momentum) {mb:.0f} MB, "
          f"medians of {args.repeats}, slowest rank")
    for label, key in (("state.sync()", "sync"), ("MPI Bcast of the same bytes", "bcast"),
                       (f"MPI Send rank 0 -> {newcomer}", "send")):
        versus = f"   sync / {key} = {median['sync'] / median[key]:.2f}" if key != "sync" else ""
        print(f"  {label:30}{median[key]:7.3f} s  {mb / median[key]:7.1f} MB/s{versus}")
    print(f"  (in state.sync: broadcast_parameters {median['parameters']:.3f} s, "
          f"broadcast_optimizer_state {median['optimizer']:.3f} s)")
    if args.rate:
        link = rate_bytes_per_second(args.rate) / 1e6
        report["link_mb_per_s"] = link
        print(f"  {'the link (' + args.rate + ')':30}{mb / link:7.3f} s  {link:7.1f} MB/s   "
              f"sync's rate / link's = {mb / median['sync'] / link:.2f}")
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
