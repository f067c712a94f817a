"""A classifier with a wide output head whose validation loop keeps the
previous batch's logits alive while the next forward runs (`logits =
model(x)` then the loss from them, no `del`), at a larger evaluation batch
than the training one. Training fits; the evaluation after the first epoch
runs out of memory.

    python eval_keeps_outputs.py --batch-size 16 --eval-batch-size 128
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--eval-batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--classes", type=int, default=4096)
args = parser.parse_args()

torch.manual_seed(0)
features = torch.randn(256, 64)
labels = torch.randint(args.classes, (256,))
train_loader = DataLoader(TensorDataset(features[:128], labels[:128]), batch_size=args.batch_size)
val_loader = DataLoader(
    TensorDataset(features[128:], labels[128:]), batch_size=args.eval_batch_size
)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, args.classes), nn.LogSoftmax(dim=1)
)
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

for epoch in range(args.epochs):
    model.train()
    for x, y in train_loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in val_loader:
            logits = model(x)
            total += criterion(logits, y).item()
    print(f"epoch {epoch}: val loss {total:.3f}")
