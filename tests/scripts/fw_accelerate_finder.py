"""accelerate's batch-size finder, as its `by_feature/memory.py` example
uses it: the training function decorated with `find_executable_batch_size`,
which catches an out-of-memory error and calls it again with a batch 10%
smaller (by half in older accelerate), until one fits.

    python fw_accelerate_finder.py --batch-size 512   # 512 OOMs under oomdoc on 9MiB

The CPU unless `--gpu`; one process, nothing saved.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size
from torch.utils.data import DataLoader, TensorDataset


def build_model(width, depth):
    layers = [nn.Linear(32, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not args.gpu)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 32), torch.randint(0, 10, (args.samples,)))

    @find_executable_batch_size(starting_batch_size=args.batch_size)
    def train(batch_size):
        accelerator.free_memory()  # what the failed try left behind
        accelerator.print(f"trying batch {batch_size}")
        model = build_model(args.width, args.depth)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 >= args.steps:
                break
        accelerator.print(f"trained at batch {batch_size}")

    train()


if __name__ == "__main__":
    main()
