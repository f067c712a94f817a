"""A training loop that keeps each step's features with their autograd history.

    python keep_features.py [--steps N] [--batch-size B] [--width W] [--detach]

Each step appends `features` (the encoder's output, still attached to its
autograd graph) to a list, as code that collects embeddings for later
analysis and forgets `.detach()`: memory grows every step until the device
runs out (on a capped simulated device: `oomdoc run --device cpu
--device-memory 16MiB keep_features.py --steps 1000`). `--detach` is the
fixed loop. Prints `step N: loss L (T ms, cpu C ms)` per step: the step's
wall time and the process's CPU time (steadier on a shared machine).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Encoder(nn.Module):
    def __init__(self, inputs, width, depth):
        super().__init__()
        layers = [nn.Linear(inputs, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--detach", action="store_true", help="the fixed loop")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder = Encoder(args.inputs, args.width, args.depth).to(device)
    head = nn.Linear(args.width, args.classes).to(device)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-3)
    inputs = torch.randn(16, args.batch_size, args.inputs, device=device)
    targets = torch.randint(0, args.classes, (16, args.batch_size), device=device)
    kept = []
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        x, y = inputs[step % 16], targets[step % 16]
        features = F.normalize(encoder(x), dim=1)
        loss = F.cross_entropy(head(features), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        kept.append(features.detach() if args.detach else features)  # the leak
        loss_value = loss.item()  # waits for the GPU, so the step time is real
        now, now_cpu = time.perf_counter(), time.process_time()
        print(
            f"step {step}: loss {loss_value:.4f} ({1000 * (now - last):.3f} ms, "
            f"cpu {1000 * (now_cpu - last_cpu):.3f} ms)",
            flush=True,
        )
        last, last_cpu = now, now_cpu
    print(f"kept {len(kept)} feature batches")


if __name__ == "__main__":
    main()
