"""A small MLP trainer for the `oomdoc check` tests: DataLoader, AdamW, and a
batch size on the command line, so activation memory scales with it."""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2048)
    arguments = parser.parse_args()

    torch.manual_seed(0)
    features, classes = 128, 10
    dataset = TensorDataset(
        torch.randn(arguments.samples, features), torch.randint(0, classes, (arguments.samples,))
    )
    loader = DataLoader(dataset, batch_size=arguments.batch_size, shuffle=True, drop_last=True)

    blocks = []
    width = features
    for _ in range(arguments.layers):
        blocks += [nn.Linear(width, arguments.hidden), nn.GELU()]
        width = arguments.hidden
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the simulated device hides CUDA
    model = nn.Sequential(*blocks, nn.Linear(width, classes)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    step = 0
    while step < arguments.steps:
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            step += 1
            if step >= arguments.steps:
                break
    print(f"trained {step} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
