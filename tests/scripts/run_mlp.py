"""An MLP trainer (DataLoader, AdamW) for oomdoc run's tests.

At --batch-size 2048 it runs out of memory on a 256 MiB simulated device;
at --batch-size 64 it fits.
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2048)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(512, 2048),
    nn.ReLU(),
    nn.Linear(2048, 2048),
    nn.ReLU(),
    nn.Linear(2048, 2048),
    nn.ReLU(),
    nn.Linear(2048, 2048),
    nn.ReLU(),
    nn.Linear(2048, 10),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

for _epoch in range(args.epochs):
    for step, (inputs, targets) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
print("done", flush=True)
