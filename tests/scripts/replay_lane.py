"""Replays side by side, one misbehaving: runs out of memory normally; in a
replay (OOMDOC_REPLAY=1) under autocast it misbehaves inside its first step,
that is while it holds the device lock of replays that run side by side:

    --under-autocast hang   sleeps for an hour (until --replay-timeout kills it)
    --under-autocast die    kills itself (SIGKILL: no capture)

Replays of other fixes run normally and must still report.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--under-autocast", choices=["hang", "die"], default="hang")
parser.add_argument("--batch-size", type=int, default=4096)
args = parser.parse_args()
REPLAY = bool(os.environ.get("OOMDOC_REPLAY"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)

    def forward(self, x):
        if REPLAY and torch.is_autocast_enabled("cpu"):
            if args.under_autocast == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return x + torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    x = torch.randn(args.batch_size, 128)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
