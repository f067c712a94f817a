"""A Lightning `Trainer` run for the framework tests: a LightningModule with a
small nn.TransformerEncoder, random token data, argparse flags.

    python fw_lightning_trainer.py --batch-size 64              # OOMs under oomdoc on 48MiB
    python fw_lightning_trainer.py --batch-size 64 --precision bf16-mixed --accumulate-grad-batches 2
    python fw_lightning_trainer.py --batch-size 64 --gradient-checkpointing

No logger, checkpoints, progress bar, model summary or sanity check; the CPU
only, one process.
"""

import argparse
import logging
import warnings

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset


class RandomTokens(Dataset):
    """A small fixed pool of token sequences (the simulated device counts the
    dataset, so it does not grow with the batch size)."""

    POOL = 64

    def __init__(self, length, seq_len, vocab_size):
        self.length = length
        generator = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, vocab_size, (self.POOL, seq_len), generator=generator)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.pool[index % self.POOL]


class TokenData(L.LightningDataModule):
    def __init__(self, batch_size, batches, seq_len, vocab_size):
        super().__init__()
        self.batch_size = batch_size
        self.data = RandomTokens(batches * batch_size, seq_len, vocab_size)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, num_workers=0)


class LitEncoder(L.LightningModule):
    def __init__(self, vocab_size, width, depth, heads, checkpointing=False):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(vocab_size, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        if not self.checkpointing:
            return self.head(self.encoder(self.embed(tokens)))
        # Activation checkpointing by hand: each layer's activations are
        # recomputed in backward instead of kept.
        x = self.embed(tokens)
        for layer in self.encoder.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)

    def training_step(self, tokens, batch_index):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=33)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--accelerator", default="cpu", help="cpu (the tests) or gpu")
    parser.add_argument(
        "--devices", type=int, default=1, help="processes (Lightning launches them)"
    )
    parser.add_argument("--strategy", default="auto", help="auto, ddp (subprocesses), ddp_spawn")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    # Tiny ops: one thread is much faster than two contending ones on a busy CI machine.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LitEncoder(
        args.vocab_size, args.width, args.depth, heads=4, checkpointing=args.gradient_checkpointing
    )
    # Enough batches for `steps` optimizer steps of full accumulation cycles.
    batches = args.steps * args.accumulate_grad_batches
    data = TokenData(args.batch_size, batches, args.seq_len, args.vocab_size)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.steps,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate_grad_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    print(f"trained {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
