"""A trainer in nanoGPT's idiom around a compiled model: `model =
torch.compile(model)`, a `ctx` of bf16 autocast, `get_batch` from a token
pool, gradient accumulation, and `estimate_loss()` under `@torch.no_grad()`
with `model.eval()`/`model.train()` every `eval_interval` iterations. At the
end it prints what Dynamo compiled and the script's own peak:

    compiled: graphs G breaks B recompiles R peak P

    python tests/scripts/compiled_gpt.py --device cuda --batch_size 8
"""

import argparse
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gpt_train import GPT  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--backend", default="inductor")
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--max_iters", type=int, default=6)
parser.add_argument("--eval_interval", type=int, default=3)
parser.add_argument("--eval_iters", type=int, default=2)
parser.add_argument("--n_layer", type=int, default=6)
parser.add_argument("--n_embd", type=int, default=512)
parser.add_argument("--block_size", type=int, default=256)
parser.add_argument("--vocab_size", type=int, default=8192)
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
args = parser.parse_args()

torch.manual_seed(1337)
device_type = "cuda" if "cuda" in args.device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
ctx = (
    nullcontext()
    if args.dtype == "float32"
    else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
)
pool = torch.randint(args.vocab_size, (256, args.block_size + 1))


def get_batch(split, it):
    offset = 0 if split == "train" else 128
    rows = (torch.arange(args.batch_size) * 7 + it + offset) % pool.shape[0]
    x, y = pool[rows, :-1], pool[rows, 1:]
    if device_type == "cuda":
        return x.pin_memory().to(args.device, non_blocking=True), y.pin_memory().to(
            args.device, non_blocking=True
        )
    return x.to(args.device), y.to(args.device)


model = GPT(
    layers=args.n_layer,
    width=args.n_embd,
    heads=max(1, args.n_embd // 64),
    seq_len=args.block_size,
    vocab=args.vocab_size,
).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
model = torch.compile(model, backend=args.backend)


def loss_of(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split, k)
            with ctx:
                losses[k] = loss_of(model(X), Y).item()
        out[split] = losses.mean()
    model.train()
    return out


X, Y = get_batch("train", 0)
for iter_num in range(args.max_iters):
    if iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(args.gradient_accumulation_steps):
        with ctx:
            loss = loss_of(model(X), Y) / args.gradient_accumulation_steps
        X, Y = get_batch("train", iter_num * args.gradient_accumulation_steps + micro_step + 1)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {iter_num}: loss {loss.item() * args.gradient_accumulation_steps:.4f}", flush=True)

from torch._dynamo.utils import counters  # noqa: E402

peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else 0
print(
    f"compiled: graphs {counters['stats']['unique_graphs']} "
    f"breaks {sum(counters['graph_break'].values())} "
    f"recompiles {sum(counters['recompiles'].values()) if 'recompiles' in counters else 0} "
    f"peak {peak}",
    flush=True,
)
