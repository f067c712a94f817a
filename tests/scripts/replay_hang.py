"""Runs out of memory normally; in a replay (OOMDOC_REPLAY=1) it hangs before
its first step, whatever the fix, so that --replay-timeout has something to kill.
`--batch-size N` (default 4096): a flag the smaller-batch replay can change."""

import argparse
import os
import time

import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=4096)
batch = parser.parse_args().batch_size
if os.environ.get("OOMDOC_REPLAY"):
    time.sleep(3600)
for _step in range(3):
    x = torch.randn(batch, 64)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
