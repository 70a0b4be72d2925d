"""A torchvision script under hvd_sgp: a ResNet-18 on FakeData, a few SGP steps on each rank;
run by test_ecosystem.py in a Python where torchvision loads."""
import torch
import torchvision
from torchvision import datasets, models, transforms

import hvd_sgp.torch as hvd

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(hvd.rank())
data = datasets.FakeData(size=16, image_size=(3, 32, 32), num_classes=10,
                         transform=transforms.ToTensor(), random_offset=hvd.rank())
loader = torch.utils.data.DataLoader(data, batch_size=4)
model = models.resnet18(num_classes=10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
for images, labels in loader:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss), loss
figures = optimizer.metrics()
assert figures["iteration"] == 4, figures
print(f"rank {hvd.rank()}: torch {torch.__version__} torchvision {torchvision.__version__} "
      f"resnet18 trained 4 steps, {figures['bytes_sent']} bytes sent", flush=True)
