"""A Horovod script that keeps ``import horovod.torch as hvd`` and swaps only its optimizer for
hvd_sgp's; both libraries share one MPI world. Run by test_horovod.py when Horovod is installed
(see mpi_checks.py for the harness)."""
import torch

import horovod.torch as hvd
import hvd_sgp
from mpi_checks import Checks

hvd.init()
checks = Checks("horovod", hvd.rank, hvd.size, hvd.barrier)


@checks
def check_coexistence():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd_sgp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                             named_parameters=model.named_parameters())
    true_w = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    for _ in range(200):
        x = torch.randn(16, 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), x @ true_w.T).backward()
        optimizer.step()
    error = hvd.allreduce((model.weight - true_w).abs().max(), op=hvd.Max).item()
    assert error < 0.05, error
    assert hvd_sgp.common.runtime.size() == hvd.size()
    return f"coexistence: {hvd.size()} ranks, error {error:.2e}"


checks.run()
