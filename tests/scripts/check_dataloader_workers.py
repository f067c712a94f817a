"""A small regression trained from a DataLoader with worker processes."""

import torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    data = TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=32, num_workers=2, prefetch_factor=4)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in loader:
        loss = (model(inputs) - targets).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
