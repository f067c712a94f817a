"""A word-level language model in the idiom of pytorch/examples'
word_language_model, small enough for the simulated device.

    python word_lm_style.py --batch_size 20 --epochs 2

What makes it a real-idiom script rather than one shaped for oomdoc:
- no optimizer: a manual SGD update (`p.data.add_(p.grad, alpha=-lr)`) after
  gradient clipping, `model.zero_grad()` before each forward;
- the loss is a module (`nn.NLLLoss()`) applied to the model's log-softmax;
- the corpus is batchified into one tensor on the device up front, hidden
  states are detached between batches (`repackage_hidden`);
- evaluation after each epoch under `torch.no_grad()` with `model.eval()`, at
  its own batch size (`--eval_batch_size`), summing `loss.item()`.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch word-level LSTM language model")
parser.add_argument("--emsize", type=int, default=64)
parser.add_argument("--nhid", type=int, default=64)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--ntokens", type=int, default=2000)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch_size", type=int, default=20, metavar="N")
parser.add_argument("--eval_batch_size", type=int, default=10, metavar="N")
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--train_tokens", type=int, default=12000)
parser.add_argument("--seed", type=int, default=1111)
# What oomdoc's prescription for a manual update says to write (the original
# has no accumulation): the update every N micro-batches.
parser.add_argument("--accumulate", type=int, default=1, metavar="N")
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
generator = torch.Generator().manual_seed(0)
train_ids = torch.randint(args.ntokens, (args.train_tokens,), generator=generator)
val_ids = torch.randint(args.ntokens, (args.train_tokens // 4,), generator=generator)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


train_data = batchify(train_ids, args.batch_size)
val_data = batchify(val_ids, args.eval_batch_size)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.decoder.out_features)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


model = RNNModel(args.ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].view(-1)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(args.eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train(epoch, lr):
    model.train()
    total_loss = 0.0
    hidden = model.init_hidden(args.batch_size)
    model.zero_grad()
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        (loss / args.accumulate).backward()
        if (batch + 1) % args.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            model.zero_grad()
        total_loss += loss.item()
        if batch % 5 == 0:
            print(f"| epoch {epoch} | batch {batch} | loss {total_loss / (batch + 1):.2f}")


lr = args.lr
for epoch in range(1, args.epochs + 1):
    train(epoch, lr)
    val_loss = evaluate(val_data)
    print(
        f"| end of epoch {epoch} | valid loss {val_loss:.2f} | valid ppl {math.exp(min(val_loss, 50)):.2f}"
    )
    lr /= 4.0
