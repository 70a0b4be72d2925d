"""Training with the timeline and the metrics log on; run by test_telemetry.py.
argv: TOPOLOGY. Checks consensus_metrics() against a brute-force allgather."""
import sys

import torch

import hvd_sgp.torch as hvd

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               topology=sys.argv[1])
for step in range(40):
    opt.zero_grad()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()
cheap = opt.metrics()
assert cheap["iteration"] == 40 and cheap["bytes_sent"] > 0 and cheap["total_wait_seconds"] >= 0
c = opt.consensus_metrics()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
everyone = hvd.allgather(flat.reshape(1, -1))
mean = everyone.mean(0)
assert abs(c["deviation"] - (flat - mean).norm().item()) < 1e-9
distance = ((everyone - mean).norm(dim=1) ** 2).mean().sqrt().item()
assert abs(c["distance"] - distance) < 1e-9, (c["distance"], distance)
assert c["elastic"] >= c["deviation"] / 0.05 - 1e-12
if hvd.rank() == 0:
    print(f"telemetry ok: distance {c['distance']:.3e}", flush=True)
