"""Training with a validation pass after each epoch that forgets
torch.no_grad(): the validation forwards record graphs no backward uses.

    python suggest_train_then_eval.py [--epochs N] [--no-grad] [--two-views]

--no-grad is the correct loop; --two-views calls the model twice per training
step (one backward for both), which is not an evaluation.
"""

import argparse
import contextlib

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-batches", type=int, default=4)
    parser.add_argument("--val-batches", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--no-grad", action="store_true")
    parser.add_argument("--two-views", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 10)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        for _ in range(args.train_batches):
            inputs = torch.randn(args.batch_size, args.width, device=device)
            targets = torch.randint(0, 10, (args.batch_size,), device=device)
            loss = loss_fn(model(inputs), targets)
            if args.two_views:
                loss = loss + loss_fn(model(inputs + 0.1 * torch.randn_like(inputs)), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        total = 0.0
        context = torch.no_grad() if args.no_grad else contextlib.nullcontext()
        with context:
            for _ in range(args.val_batches):
                inputs = torch.randn(args.batch_size, args.width, device=device)
                targets = torch.randint(0, 10, (args.batch_size,), device=device)
                total += loss_fn(model(inputs), targets).item()
        print(f"epoch {epoch}: validation loss {total / args.val_batches:.4f}")


if __name__ == "__main__":
    main()
