"""A trainer in the pytorch/examples word_language_model idiom: argparse
`--batch_size 20`, the corpus cut into `batch_size` columns, no optimizer:
the gradients are clipped and the parameters updated by hand
(`p.data.add_(p.grad, alpha=-lr)`), `model.zero_grad()` before each batch.
Small, for the simulated device.

    python opts_manual_sgd.py --batch_size 20
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="tiny word-language-model-style training")
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--batch_size", type=int, default=20, metavar="N")
parser.add_argument("--bptt", type=int, default=16)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

ntokens, emsize = 64, 64
torch.manual_seed(0)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(ntokens, emsize)
        self.hidden = nn.Linear(emsize, 4 * emsize)
        self.decoder = nn.Linear(4 * emsize, ntokens)

    def forward(self, x):
        return self.decoder(torch.tanh(self.hidden(self.encoder(x))))


corpus = torch.arange((args.steps * args.bptt + 1) * args.batch_size) % ntokens
train_data = batchify(corpus, args.batch_size)
model = TinyLM()
criterion = nn.CrossEntropyLoss()
lr = args.lr
for batch, i in enumerate(range(0, args.steps * args.bptt, args.bptt)):
    data, targets = train_data[i : i + args.bptt], train_data[i + 1 : i + 1 + args.bptt]
    model.zero_grad()
    output = model(data)
    loss = criterion(output.view(-1, ntokens), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
    print(f"batch {batch}: loss {loss.item():.4f}", flush=True)
