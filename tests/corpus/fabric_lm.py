"""Next-word prediction with Lightning Fabric, in the shape of Lightning's
examples/fabric/language_model/train.py: the Transformer shipped in
lightning.pytorch.demos, fabric.setup / setup_dataloaders, clip_gradients,
a validation pass under @torch.no_grad() after each epoch. Random tokens
stand in for WikiText2 (no download)."""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, Dataset, random_split


class RandomText(Dataset):
    def __init__(self, tokens=200_000, vocab_size=33278, block_size=35):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.data = torch.randint(0, vocab_size, (tokens,))

    def __len__(self):
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index):
        start = index * self.block_size
        end = start + self.block_size
        return self.data[start:end], self.data[start + 1 : end + 1]


def get_dataloaders(dataset, batch_size):
    n = len(dataset)
    generator = torch.Generator().manual_seed(42)
    train_set, val_set, test_set = random_split(dataset, [n - 400, 200, 200], generator=generator)
    train_dataloader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    val_dataloader = DataLoader(val_set, batch_size=batch_size, shuffle=False)
    test_dataloader = DataLoader(test_set, batch_size=batch_size, shuffle=False)
    return train_dataloader, val_dataloader, test_dataloader


def train(fabric, model, optimizer, train_dataloader, val_dataloader, args):
    for epoch in range(args.epochs):
        train_epoch(fabric, model, optimizer, train_dataloader, epoch, args)
        val_loss = validate(fabric, model, val_dataloader)
        fabric.print(f"val loss {val_loss.item():.4f}")


def train_epoch(fabric, model, optimizer, train_dataloader, epoch, args):
    for batch_idx, batch in enumerate(train_dataloader):
        input, target = batch
        output = model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, clip_val=0.25)
        optimizer.step()
        optimizer.zero_grad()
        if batch_idx % 10 == 0:
            fabric.print(f"epoch: {epoch} - iteration: {batch_idx} - loss {loss.item():.4f}")
        if args.max_steps and batch_idx + 1 >= args.max_steps:
            break


@torch.no_grad()
def validate(fabric, model, val_dataloader):
    fabric.print("Validating ...")
    model.eval()
    losses = torch.zeros(len(val_dataloader))
    for k, batch in enumerate(val_dataloader):
        input, target = batch
        output = model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        losses[k] = loss.item()
    out = losses.mean()
    model.train()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=33278)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()
    L.seed_everything(42)
    fabric = L.Fabric(accelerator=args.accelerator, devices=1)
    dataset = RandomText(vocab_size=args.vocab_size)
    train_dataloader, val_dataloader, _ = get_dataloaders(dataset, args.batch_size)
    model = Transformer(vocab_size=dataset.vocab_size, nlayers=args.nlayers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    train_dataloader, val_dataloader = fabric.setup_dataloaders(train_dataloader, val_dataloader)
    train(fabric, model, optimizer, train_dataloader, val_dataloader, args)


if __name__ == "__main__":
    main()
