"""A GPT-style language-model trainer, the kind of script that runs out of memory.

    python examples/gpt_train.py --batch-size 32            # the reference model
    python examples/gpt_train.py --preset tiny --batch-size 64

The reference preset is GPT with 12 layers x 1024 wide, 16 heads, sequence 512
and a 32000-token vocabulary, trained with AdamW in fp32: on an H100 capped
with `oomdoc run --device-memory 16GiB` the largest batch that fits is about 20,
so `--batch-size 32` runs out of memory.

The tiny preset (4 layers x 128 wide, sequence 64, vocabulary 1024) runs on a
CPU; `oomdoc run --device cpu --device-memory 192MiB ... --preset tiny
--batch-size 64` runs out of memory on the simulated device.

The data are random tokens from a DataLoader, so the script needs no files.
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

PRESETS = {
    "reference": dict(layers=12, width=1024, heads=16, seq_len=512, vocab=32000),
    "tiny": dict(layers=4, width=128, heads=4, seq_len=64, vocab=1024),
}


class RandomTokens(Dataset):
    """Deterministic random token sequences: sample i is always the same."""

    def __init__(self, length, seq_len, vocab):
        self.length, self.seq_len, self.vocab = length, seq_len, vocab

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=generator)
        return tokens[:-1], tokens[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (
            t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers, width, heads, seq_len, vocab):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * layers))

    checkpointing = False

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.checkpointing:  # the fix by hand: recompute each block in backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (the effective batch is batch size x this)",
    )
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--checkpoint-dir", default=None, help="save the model here at the end")
    parser.add_argument(
        "--sync-every",
        type=int,
        default=1,
        help="read the loss (and wait for the GPU) every N steps only; the time printed is per step",
    )
    # The fixes oomdoc replays, written by hand, to compare with the replays.
    parser.add_argument(
        "--autocast", choices=["bf16", "fp16"], default=None, help="mixed precision by hand"
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing by hand"
    )
    args = parser.parse_args()

    config = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    model.checkpointing = args.checkpointing
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    accumulation = args.gradient_accumulation_steps
    data = RandomTokens(
        args.steps * accumulation * args.batch_size, config["seq_len"], config["vocab"]
    )
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)

    model.train()
    last = time.perf_counter()
    for micro_step, (tokens, targets) in enumerate(loader):
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.autocast(
            device_type=device, dtype=autocast_dtype, enabled=autocast_dtype is not None
        ):
            logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        (loss / accumulation).backward()
        if (micro_step + 1) % accumulation:
            continue  # gradients add up until the last micro-batch of the step
        step = micro_step // accumulation
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.sync_every:
            continue  # no sync: the next batch is loaded while the GPU works
        loss_value = loss.item()  # waits for the GPU, so the step time below is real
        now = time.perf_counter()
        print(
            f"step {step}: loss {loss_value:.4f} ({1000 * (now - last) / args.sync_every:.1f} ms)",
            flush=True,
        )
        last = now

    # Replays set OOMDOC_REPLAY=1: skip side effects such as checkpoints.
    if args.checkpoint_dir and not os.environ.get("OOMDOC_REPLAY"):
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.checkpoint_dir, "gpt.pt"))


if __name__ == "__main__":
    main()
