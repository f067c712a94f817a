"""Training in children started with multiprocessing.Process (not torch's
spawn): oomdoc cannot capture them and must say so first."""

import multiprocessing as mp

import torch
import torch.nn as nn


def train(rank):
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(32, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    processes = [mp.get_context("spawn").Process(target=train, args=(rank,)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
