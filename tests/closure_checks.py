"""optimizer.step(closure), as Lightning and torch's closure convention call it: the closure's
backward runs before the exchange, so mode='allreduce' averages its gradients and the ranks
stay one model. Run by test_ecosystem.py."""
import torch

import hvd_sgp.torch as hvd

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), mode="allreduce")
data = torch.randn(5, 8, 4, generator=torch.Generator().manual_seed(1 + hvd.rank()))
for batch in data:
    def closure():
        optimizer.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss is not None and loss.requires_grad
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
spread = (hvd.allgather(flat.reshape(1, -1)) - flat).abs().max().item()
assert spread == 0.0, f"rank {hvd.rank()}: ranks differ by {spread} after step(closure)"
print(f"rank {hvd.rank()}: step(closure) kept one model", flush=True)
