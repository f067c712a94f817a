"""A dataset that runs a small encoder with parameters on each sample, in
forked DataLoader workers (`--workers N`), feeding a trained classifier."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
args = parser.parse_args()


class EncodedSamples(Dataset):
    def __init__(self):
        torch.manual_seed(0)
        self.encoder = nn.Linear(8, 8)

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return self.encoder(torch.randn(8)).detach(), index % 2


model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(EncodedSamples(), batch_size=args.batch_size, num_workers=args.workers):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("done")
