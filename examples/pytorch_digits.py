"""Train a small MLP on scikit-learn's digits with Horovod's PyTorch API.

The only difference from the Horovod script is the import line. SGP choices come from the
environment (HVD_SGP_TOPOLOGY, HVD_SGP_PEERS, HVD_SGP_MODE, ...), so one script serves all modes:

    mpirun -np 4 -x HVD_SGP_LOCAL_SIZE=1 python examples/pytorch_digits.py
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import digits_data  # scikit-learn's digits, split once and cached
import hvd_sgp.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--checkpoint", default="", help="save the model here on rank 0")
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed + hvd.rank())  # different initialisations: broadcast fixes that
torch.set_num_threads(1)
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

x_train, x_test, y_train, y_test = map(torch.from_numpy, digits_data.split(0.25, seed=0))
train_set = TensorDataset(x_train, y_train)
sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)


def evaluate():
    model.eval()
    with torch.no_grad():
        logits = model(x_test.to(device))
        accuracy = (logits.argmax(1).cpu() == y_test).float().mean()
    model.train()
    return hvd.allreduce(accuracy, name="accuracy").item()


for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    total = torch.zeros(())
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.detach().cpu() * len(data)
    mean_loss = hvd.allreduce(total / len(sampler), name="loss").item()
    accuracy = evaluate()
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.4f}",
              flush=True)

# How far each rank's model is from the network average (SGP keeps them close, not equal).
flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
mean = hvd.allreduce(flat, name="params")
relative = ((flat - mean).norm() / mean.norm()).reshape(1)
worst = hvd.allreduce(relative, op=hvd.Max).item()
if hvd.rank() == 0:
    print(f"final test accuracy {accuracy:.4f}", flush=True)
    print(f"max relative deviation from the network average {worst:.4f}", flush=True)
    if args.checkpoint:
        torch.save(model.state_dict(), args.checkpoint)
