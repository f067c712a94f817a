"""Lightning's batch-size finder, as its docs use it: a `BatchSizeFinder`
callback (binary search from `init_val`) that runs a few steps at each
trial, catches the out-of-memory error of one that does not fit, and trains
at the largest that did. The encoder of fw_lightning_trainer.py.

    python fw_lightning_finder.py --batch-size 8    # finds its batch under oomdoc on 48MiB

No logger, checkpoints, progress bar or model summary; the CPU only.
"""

import argparse
import logging
import warnings

import lightning as L
import torch
from fw_lightning_trainer import LitEncoder, RandomTokens
from lightning.pytorch.callbacks import BatchSizeFinder
from torch.utils.data import DataLoader


class TokenData(L.LightningDataModule):
    """`batch_size` is the attribute the finder sets."""

    def __init__(self, batch_size, seq_len, vocab_size):
        super().__init__()
        self.batch_size = batch_size
        self.data = RandomTokens(1 << 20, seq_len, vocab_size)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8, help="the finder's first trial")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LitEncoder(256, 64, 2, heads=4)
    data = TokenData(args.batch_size, 33, 256)
    finder = BatchSizeFinder(mode="binsearch", init_val=args.batch_size, max_trials=25)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[finder],
    )
    trainer.fit(model, datamodule=data)
    print(f"found batch {data.batch_size}, trained {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
