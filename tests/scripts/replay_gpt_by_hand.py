"""examples/gpt_train.py's training loop with a fix written in by hand, to
compare with oomdoc's replay of the same fix on the unmodified script.

    python replay_gpt_by_hand.py --batch-size 32 --autocast
    python replay_gpt_by_hand.py --batch-size 32 --checkpointing
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gpt_train import GPT, PRESETS, RandomTokens  # noqa: E402


def forward(model, tokens, checkpointing):
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.token_embedding(tokens) + model.position_embedding(positions)
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=False) if checkpointing else block(x)
    return model.lm_head(model.ln_f(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()

    config = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = DataLoader(RandomTokens(args.steps * args.batch_size, config["seq_len"], config["vocab"]), batch_size=args.batch_size)
    for step, (tokens, targets) in enumerate(loader):
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.autocast(device, dtype=dtype, enabled=args.autocast):
            logits = model(tokens) if not args.checkpointing else forward(model, tokens, True)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
