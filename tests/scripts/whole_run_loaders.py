"""Variable-length sequences through DataLoaders, for oomdoc.capture.whole_run:
a shuffled training loader padded to the longest sample, and an evaluation
loop after each epoch at twice the batch (or, --gather, one that keeps every
batch's outputs, as a metrics loop does). Prints each batch's shape.

    python whole_run_loaders.py --batch_size 4 [--bucketing] [--iterable] [--gather] [--workers 2]
"""

import argparse

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, IterableDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--bucketing", action="store_true")
parser.add_argument("--iterable", action="store_true")
parser.add_argument("--gather", action="store_true")
args = parser.parse_args()

generator = torch.Generator().manual_seed(0)
# Lengths 4..40, the longest (40) at index 37 of the training set, 33 at index 5 of the validation set.
TRAIN_LENGTHS = [4 + (i * 7) % 30 for i in range(64)]
TRAIN_LENGTHS[37] = 40
VAL_LENGTHS = [4 + (i * 5) % 20 for i in range(24)]
VAL_LENGTHS[5] = 33


class Sequences(Dataset):
    def __init__(self, lengths):
        self.samples = [torch.randint(1, 100, (n,), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        tokens = self.samples[index]
        return tokens, int(tokens[0]) % 2


class Streamed(IterableDataset):
    def __iter__(self):
        for n in TRAIN_LENGTHS:
            yield torch.randint(1, 100, (n,)), 0


class Buckets(torch.utils.data.Sampler):
    """Batches of similar lengths, in a fixed order (a bucketing sampler)."""

    def __init__(self, lengths, batch_size):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def pad_collate(batch):
    tokens = pad_sequence([sample for sample, _ in batch], batch_first=True)
    return tokens, torch.tensor([label for _, label in batch])


train_set = Streamed() if args.iterable else Sequences(TRAIN_LENGTHS)
if args.bucketing:
    train_loader = DataLoader(
        train_set, batch_sampler=Buckets(TRAIN_LENGTHS, args.batch_size), collate_fn=pad_collate
    )
else:
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=not args.iterable,
        collate_fn=pad_collate,
        num_workers=args.workers,
    )
val_loader = DataLoader(
    Sequences(VAL_LENGTHS), batch_size=args.batch_size * 2, collate_fn=pad_collate
)

model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 256))
head = nn.Linear(256, 2)
optimizer = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.1)
criterion = nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    model.train()
    for tokens, labels in train_loader:
        loss = criterion(head(model(tokens).mean(1)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print("train", epoch, tuple(tokens.shape), flush=True)
    model.eval()
    kept = []
    with torch.no_grad():
        for tokens, _labels in val_loader:
            logits = model(tokens)
            if args.gather:
                kept.append(logits)
            print("eval", epoch, tuple(tokens.shape), flush=True)
print("done", flush=True)
