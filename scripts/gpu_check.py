"""CUDA and NCCL paths of hvd_sgp.torch; run by scripts/gpu_check.sh on a GPU machine.

Each rank uses GPU local_rank % device_count. Checks: collectives on CUDA tensors come back on
the GPU with exact values; the torch kit's fp16/bf16 wire format on the GPU is byte-identical to
the numpy codecs; complete-graph SGP equals AllReduce SGD on CUDA parameters, staged through
pinned host memory on a side stream, and mixed on the GPU with MPI reading device memory when
the MPI is CUDA-aware; Overlap SGP trains; with 2 ranks per node, the NCCL in-node gradient
average keeps the node's ranks identical.
"""
import sys
import time

import numpy as np
import torch

import hvd_sgp.torch as hvd
from hvd_sgp.common import runtime
from hvd_sgp.common.codecs import WEIGHT_BYTES, codec, pack
from hvd_sgp.torch import flat as flat_module
from hvd_sgp.torch.tensor_kit import TorchKit

hvd.init()
assert torch.cuda.is_available(), "no CUDA device"
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
device = torch.device("cuda")
n, me = hvd.size(), hvd.rank()


def ok(name):
    hvd.barrier()
    if me == 0:
        print(f"ok {name}", flush=True)


t = torch.full((1000,), float(me), device=device)
avg = hvd.allreduce(t)
assert avg.is_cuda and torch.allclose(avg, torch.full_like(avg, (n - 1) / 2))
b = hvd.broadcast(t, root_rank=0)
assert b.is_cuda and float(b.sum()) == 0.0
ok("collectives on CUDA tensors")

values = torch.randn(1001, device=device) * 100
for name in ("fp16", "bf16"):
    wire = codec(name)
    size = wire.nbytes(1001) + WEIGHT_BYTES
    words = torch.empty(size, dtype=torch.uint8, device=device)
    TorchKit().pack(wire, values, 0.375, words)
    expected = np.empty(size, dtype=np.uint8)
    pack(wire, values.cpu().numpy(), 0.375, expected)
    assert np.array_equal(words.cpu().numpy(), expected), name
    decoded, weight = TorchKit().unpack(wire, words, 1001)
    assert decoded.is_cuda and weight == 0.375
ok("fp16/bf16 wire messages packed on the GPU equal the numpy codecs' bytes")


def train(**kwargs):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), **kwargs)
    gen = torch.Generator(device=device).manual_seed(100 + hvd.cross_rank())
    began = time.perf_counter()
    for _ in range(30):
        x = torch.randn(64, 256, device=device, generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        opt.step()
    opt.synchronize_gossip()
    torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), \
        (time.perf_counter() - began) / 30


chosen = flat_module.placement
placements = ["staged"] + (["direct"] if runtime.cuda_aware_mpi() else [])
for where in placements:
    flat_module.placement = lambda device, where=where: where
    sgp, t_sgp = train(topology="complete")
    allreduce, t_ar = train(mode="allreduce")
    diff = (sgp - allreduce).abs().max().item()
    assert diff < 1e-4, diff
    ok(f"{where}: complete-graph SGP equals AllReduce SGD on CUDA ({diff:.1e}); "
       f"{t_sgp * 1e3:.1f} vs {t_ar * 1e3:.1f} ms/step")
flat_module.placement = chosen
if "direct" not in placements:
    ok("direct (CUDA-aware) path skipped: this MPI is not CUDA-aware (HVD_SGP_CUDA_AWARE unset)")
osgp, t_osgp = train(overlap=True, max_delay=1)
assert torch.isfinite(osgp).all()
ok(f"Overlap SGP on CUDA parameters: {t_osgp * 1e3:.1f} ms/step")
if hvd.local_size() > 1:
    node = hvd.allgather(sgp.reshape(1, -1).cpu())
    local = node[me - hvd.local_rank(): me - hvd.local_rank() + hvd.local_size()]
    assert (local - local[0]).abs().max() == 0, "ranks of one node differ"
    ok(f"NCCL in-node average: {hvd.local_size()} ranks per node stay identical")
if me == 0:
    print(f"all GPU checks passed on {n} ranks, nccl_built={hvd.nccl_built()}", flush=True)
sys.exit(0)
