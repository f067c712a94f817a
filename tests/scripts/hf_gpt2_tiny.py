"""A tiny Hugging Face GPT-2 built from a config (no download), trained in a plain loop.

python tests/scripts/hf_gpt2_tiny.py --batch-size 8 --steps 2
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT2LMHeadModel(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, 64), device=device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
