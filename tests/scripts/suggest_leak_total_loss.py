"""A training loop that leaks memory across steps.

    python suggest_leak_total_loss.py [--steps N] [--mode sum|sum-retain|outputs|fixed]

sum         `total_loss += loss`: the running total is a tensor whose autograd
            graph reaches back through every step (the fix: loss.item())
sum-retain  the same, with backward(retain_graph=True): each step's graph
            keeps its saved activations, so device memory grows each step
outputs     `history.append(hidden.detach())`: no graph, but a tensor per step
fixed       `total_loss += loss.item()`: no leak
"""

import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--mode", choices=("sum", "sum-retain", "outputs", "fixed"), default="sum")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder = nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU()
    )
    head = nn.Linear(args.width, 10)
    model = nn.Sequential(encoder, head).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    total_loss = 0.0
    history = []
    for _step in range(args.steps):
        inputs = torch.randn(args.batch_size, args.width, device=device)
        targets = torch.randint(0, 10, (args.batch_size,), device=device)
        hidden = encoder(inputs)
        loss = loss_fn(head(hidden), targets)
        optimizer.zero_grad()
        loss.backward(retain_graph=args.mode == "sum-retain")
        optimizer.step()
        if args.mode == "fixed":
            total_loss += loss.item()
        elif args.mode == "outputs":
            total_loss += loss.item()
            history.append(hidden.detach())
        else:
            total_loss += loss  # the bug: should be loss.item()
    print(f"mean loss {float(total_loss) / args.steps:.4f}")


if __name__ == "__main__":
    main()
