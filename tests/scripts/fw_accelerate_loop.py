"""An accelerate `Accelerator` loop for the framework tests: an MLP of
residual blocks, `accelerator.prepare`, `accelerator.accumulate` and
`accelerator.backward`, argparse flags.

    python fw_accelerate_loop.py --batch-size 512      # OOMs under oomdoc on 6MiB
    python fw_accelerate_loop.py --batch-size 256 --gradient-accumulation-steps 2

The CPU only, one process, nothing saved.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class RandomFeatures(Dataset):
    """Samples from a small fixed pool, so the dataset's memory does not grow
    with the batch size (the simulated device counts it)."""

    POOL = 256

    def __init__(self, length, features, classes):
        self.length, self.classes = length, classes
        self.pool = torch.randn(self.POOL, features, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.pool[index % self.POOL], int(index % self.classes)


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, features, width, hidden, depth, classes):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=True,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    # Tiny ops: one thread is much faster than two contending ones on a busy CI machine.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(args.features, args.width, args.hidden, args.depth, 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = args.steps * args.batch_size * args.gradient_accumulation_steps
    loader = DataLoader(RandomFeatures(samples, args.features, 10), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        accelerator.print(f"batch {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
