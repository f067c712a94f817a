"""nn.DataParallel around a tiny model (on the CPU it runs the module itself)."""

import torch
import torch.nn as nn

model = nn.DataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(2):
    loss = model(torch.randn(8, 16)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
