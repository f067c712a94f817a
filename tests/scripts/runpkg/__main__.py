"""`python -m runpkg`: prints argv, then trains two steps."""

import json
import sys

import torch

print("ARGV=" + json.dumps(sys.argv[1:]))
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
