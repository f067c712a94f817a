"""An MLP trainer for the replay tests: residual MLP blocks, a DataLoader, AdamW.

    python replay_mlp_train.py --batch-size 2048              # runs out of memory
    python replay_mlp_train.py --batch-size 2048 --autocast   # the fixes, by hand
    python replay_mlp_train.py --batch-size 2048 --checkpointing

`--autocast` and `--checkpointing` apply those fixes the way a user would write
them, so the tests can compare oomdoc's replays (applied to the unmodified
script) with the same fix written into the script. The samples come from a small
fixed pool, so the dataset costs the same memory whatever the batch size.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset


class RandomFeatures(Dataset):
    """`length` samples drawn from a small fixed pool, so the dataset's
    memory does not grow with the batch size (the simulated device counts it)."""

    POOL = 256

    def __init__(self, length, features, classes):
        self.length, self.classes = length, classes
        self.pool = torch.randn(self.POOL, features, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.pool[index % self.POOL], int(index % self.classes)


class MLPBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, features, width, hidden, depth, classes, checkpointing=False):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument(
        "--autocast", action="store_true", help="bf16 autocast around forward and loss"
    )
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint each MLP block")
    parser.add_argument("--save", default=None, help="save the model here (skipped in replays)")
    parser.add_argument("--log", default=None, help="append each step's loss here (replays too)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP(
        args.features, args.width, args.hidden, args.depth, 10, checkpointing=args.checkpointing
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = RandomFeatures(args.steps * args.batch_size, args.features, 10)
    loader = DataLoader(data, batch_size=args.batch_size)

    for step, (x, y) in enumerate(loader):
        if args.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
        else:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
        if args.log:
            with open(args.log, "a") as log:
                log.write(f"step {step}: loss {loss.item():.4f}\n")

    if args.save and not os.environ.get("OOMDOC_REPLAY"):
        torch.save(model.state_dict(), args.save)


def run_and_report():
    """Hydra's `@hydra.main` idiom: any error of the job is printed and the
    process exits 1 (`sys.exit` inside the handler, the error its context)."""
    try:
        main()
    except Exception as error:
        print(f"Error executing job: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    if os.environ.get("MLP_EXITS_ON_ERROR"):
        run_and_report()
    else:
        main()
