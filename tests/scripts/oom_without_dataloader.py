"""Runs out of memory on a small device; its batch comes from no DataLoader and no flag."""

import torch

model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 512))
opt = torch.optim.Adam(model.parameters())
for _step in range(3):
    x = torch.randn(4096, 512)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
