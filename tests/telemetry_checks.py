"""Training with the timeline and the metrics log on; run by test_telemetry.py.
argv: TOPOLOGY."""
import sys

import torch

import hvd_sgp.torch as hvd
from mpi_checks import Checks

hvd.init()
torch.set_num_threads(1)
checks = Checks("telemetry", hvd.rank, hvd.size, hvd.barrier)


@checks
def check_consensus_metrics():
    """consensus_metrics() against a brute-force allgather, after 40 steps with the timeline
    and the metrics log on (the test reads both)."""
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   topology=sys.argv[1])
    for step in range(40):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    cheap = opt.metrics()
    assert cheap["iteration"] == 40 and cheap["bytes_sent"] > 0
    assert cheap["total_wait_seconds"] >= 0
    c = opt.consensus_metrics()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    everyone = hvd.allgather(flat.reshape(1, -1))
    mean = everyone.mean(0)
    assert abs(c["deviation"] - (flat - mean).norm().item()) < 1e-9
    distance = ((everyone - mean).norm(dim=1) ** 2).mean().sqrt().item()
    assert abs(c["distance"] - distance) < 1e-9, (c["distance"], distance)
    assert c["elastic"] >= c["deviation"] / 0.05 - 1e-12
    return f"telemetry: consensus distance {c['distance']:.3e}"


checks.run(argv=[])  # the command line carries the topology
