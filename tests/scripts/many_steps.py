"""Trains a tiny model for argv[1] steps; step argv[2] holds 1 MiB more for its length."""

import sys

import torch

steps, spike = int(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(steps):
    extra = torch.zeros(256 * 1024) if step == spike else None
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    del extra
