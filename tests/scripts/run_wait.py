"""Trains a tiny model forever until a signal arrives (for signal tests)."""

import time

import torch
import torch.nn as nn

model = nn.Linear(64, 64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while True:
    loss = model(torch.randn(8, 64)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if step == 3:
        print("ready", flush=True)
    time.sleep(0.01)
