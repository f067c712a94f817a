"""A trainer in the pytorch/examples imagenet idiom: argparse with the
short batch flag `-b/--batch-size` (taken as `-b 64`, `-b64`,
`--batch-size 64` or `--batch-size=64`), a DataLoader, SGD with momentum, no
accumulation option. Small, for the simulated device.

    python opts_short_batch_flag.py -b 64
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="tiny imagenet-style training")
parser.add_argument("-j", "--workers", default=0, type=int, metavar="N")
parser.add_argument("--epochs", default=1, type=int, metavar="N")
parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--steps", default=3, type=int, help="batches per epoch")


def main():
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum)
    # A small fixed pool repeated: the data costs the same whatever the batch.
    pool = torch.randn(64, 32)
    indices = torch.arange(args.steps * args.batch_size) % 64
    data = TensorDataset(indices, indices % 10)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.workers)
    for epoch in range(args.epochs):
        for i, (index, target) in enumerate(loader):
            output = model(pool[index])
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"epoch {epoch} batch {i}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
