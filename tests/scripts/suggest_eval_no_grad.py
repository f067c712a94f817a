"""An evaluation loop without torch.no_grad(): every forward records a graph
and keeps the activations a backward would need, though none ever comes.

    python suggest_eval_no_grad.py [--batches N] [--batch-size B] [--collect]

With --collect the logits are gathered in a list (still with their graphs).
"""

import argparse

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--collect", action="store_true")
    parser.add_argument("--no-grad", action="store_true", help="the correct loop, for comparison")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
    model.eval()
    correct, seen, collected = 0, 0, []
    for _ in range(args.batches):
        inputs = torch.randn(args.batch_size, args.width, device=device)
        targets = torch.randint(0, 10, (args.batch_size,), device=device)
        if args.no_grad:
            with torch.no_grad():
                logits = model(inputs)
        else:
            logits = model(inputs)  # the bug: no torch.no_grad()
        if args.collect:
            collected.append(logits)
        correct += int((logits.argmax(dim=1) == targets).sum())
        seen += len(targets)
    print(f"accuracy {correct / seen:.3f}")


if __name__ == "__main__":
    main()
