"""A variable-length text classifier in the idiom of a tutorial script:
padded batches of token ids through an embedding and a small Transformer
encoder, small enough for the simulated device.

    python varlen_text_classifier.py --batch_size 16 --epochs 1

What makes it a real-idiom script rather than one shaped for oomdoc:
- a map-style `Dataset` of token-id sequences whose lengths are long-tailed
  (lognormal clipped to [8, --max_len]: most short, a few long), generated
  from a fixed generator, so the data is the same for every seed and batch;
- `pad_collate` pads each batch to its own longest sample (`pad_sequence`),
  so memory follows the longest batch, which a shuffled loader
  (`torch.manual_seed(args.seed)`) meets at a seed-dependent later step;
- evaluation after each epoch under `model.eval()` + `torch.no_grad()` at
  twice the training batch ("no gradients, so twice the batch"), summing
  `loss.item()` and the correct predictions;
- `nn.CrossEntropyLoss` built once, AdamW, `zero_grad(set_to_none=True)`,
  accumulation written as `loss / accumulation_steps` with a step every N
  micro-batches; `--checkpointing` (torch.utils.checkpoint per encoder layer)
  and `--autocast` (bf16) as the savers oomdoc may prescribe.

Defaults, for the simulated device (`oomdoc run --device cpu
--device-memory 128MiB`): 256 training and 64 validation samples, lengths
lognormal(3.2, 0.8) clipped to [8, 512] (median 23, longest 432, in the
training set), d_model 64, 4 heads, 2 layers, vocabulary 4000, 1 epoch.
At 128 MiB batches 4 and 5 hold for the whole run on seeds 0..9; 6 and the
default 16 run out of memory on the batch holding the 432-token sample (at
16, seed 0: step 9). Run it with OMP_NUM_THREADS=1 on a shared CPU: a whole
run then takes a few seconds. Table: benchmarks/whole_run_by_hand.py.
"""

import argparse
import math

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser(description="Variable-length text classifier")
parser.add_argument("--vocab", type=int, default=4000)
parser.add_argument("--d_model", type=int, default=64)
parser.add_argument("--nhead", type=int, default=4)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--classes", type=int, default=4)
parser.add_argument("--train_size", type=int, default=256)
parser.add_argument("--val_size", type=int, default=64)
parser.add_argument("--max_len", type=int, default=512)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch_size", type=int, default=16, metavar="N")
parser.add_argument("--accumulation_steps", type=int, default=1, metavar="N")
parser.add_argument("--checkpointing", action="store_true")
parser.add_argument("--autocast", action="store_true", help="bf16 autocast")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

PAD = 0
torch.manual_seed(args.seed)
device = "cuda" if torch.cuda.is_available() else "cpu"


class SyntheticTextDataset(Dataset):
    """Token-id sequences with long-tailed lengths; the label is a function of
    the tokens so there is something to learn. Generated once from its own
    generator: the same samples for every seed and batch size."""

    def __init__(self, size, vocab, max_len, classes, data_seed):
        generator = torch.Generator().manual_seed(data_seed)
        lengths = torch.empty(size).log_normal_(mean=3.2, std=0.8, generator=generator)
        lengths = lengths.clamp(8, max_len).long()
        self.samples = []
        for length in lengths.tolist():
            tokens = torch.randint(1, vocab, (length,), generator=generator)
            label = int(tokens[:8].sum()) % classes
            self.samples.append((tokens, label))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def pad_collate(batch):
    tokens, labels = zip(*batch)
    return pad_sequence(tokens, batch_first=True, padding_value=PAD), torch.tensor(labels)


class TextClassifier(nn.Module):
    def __init__(self, vocab, d_model, nhead, nlayers, classes, max_len, checkpointing):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.position = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout=0.1, batch_first=True)
            for _ in range(nlayers)
        )
        self.head = nn.Linear(d_model, classes)
        self.checkpointing = checkpointing

    def forward(self, tokens):
        padding = tokens == PAD
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embedding(tokens) * math.sqrt(self.embedding.embedding_dim)
        x = x + self.position(positions)
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(layer, x, None, padding, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


train_set = SyntheticTextDataset(args.train_size, args.vocab, args.max_len, args.classes, 1)
val_set = SyntheticTextDataset(args.val_size, args.vocab, args.max_len, args.classes, 2)
train_loader = DataLoader(
    train_set, batch_size=args.batch_size, shuffle=True, collate_fn=pad_collate
)
val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, collate_fn=pad_collate)

model = TextClassifier(
    args.vocab,
    args.d_model,
    args.nhead,
    args.nlayers,
    args.classes,
    args.max_len,
    args.checkpointing,
).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def autocast():
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.autocast)


def evaluate():
    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for tokens, labels in val_loader:
            tokens, labels = tokens.to(device), labels.to(device)
            with autocast():
                logits = model(tokens)
                loss = criterion(logits, labels)
            total_loss += loss.item() * labels.size(0)
            correct += (logits.argmax(-1) == labels).sum().item()
            seen += labels.size(0)
    return total_loss / seen, correct / seen


for epoch in range(1, args.epochs + 1):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for i, (tokens, labels) in enumerate(train_loader):
        tokens, labels = tokens.to(device), labels.to(device)
        with autocast():
            loss = criterion(model(tokens), labels) / args.accumulation_steps
        loss.backward()
        if (i + 1) % args.accumulation_steps == 0 or i + 1 == len(train_loader):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    val_loss, val_accuracy = evaluate()
    print(f"epoch {epoch} | val loss {val_loss:.3f} | val accuracy {val_accuracy:.3f}")
