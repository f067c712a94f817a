"""A character/GPT trainer in the nanoGPT idiom, small enough for the simulated device.

    python gpt_configurator.py --batch_size=16 --gradient_accumulation_steps=2

What makes it a real-idiom script rather than one shaped for oomdoc:
- settings are module globals overridden by `--key=value` arguments through a
  configurator loop (only that form: `--key value` and unknown keys are refused);
- the loss is estimated at iteration 0, before any training, under
  `torch.no_grad()` with `model.eval()`, on `eval_iters` batches of each split;
- gradient accumulation over `gradient_accumulation_steps` micro-batches, the
  next batch fetched while the device is busy, AdamW built by the model
  (`configure_optimizers`), a cosine learning-rate schedule, gradient clipping.
- under torchrun (RANK in the environment) it is nanoGPT's DDP trainer: NCCL
  on CUDA (gloo on the CPU), one device per LOCAL_RANK, the accumulation steps
  divided by the world size, `model.require_backward_grad_sync` set on the last
  micro-step only, the loss estimated and the checkpoint kept on rank 0 alone
  (the master process), through `model.module` (`raw_model`).
"""

import math
import os
import sys
from ast import literal_eval

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------- config
batch_size = 16
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
vocab_size = 512
dropout = 0.0
learning_rate = 6e-4
max_iters = 6
eval_interval = 4
eval_iters = 2
gradient_accumulation_steps = 2
grad_clip = 1.0
dtype = "float32"  # or "bfloat16": autocast, as nanoGPT's `ctx`
use_checkpoint = False  # activation checkpointing of each block
seed = 1337
# the configurator: --key=value overrides of the globals above
for arg in sys.argv[1:]:
    if not arg.startswith("--") or "=" not in arg:
        raise SystemExit(f"unrecognised argument {arg!r}: use --key=value")
    key, val = arg[2:].split("=", 1)
    if key not in globals():
        raise SystemExit(f"Unknown config key: {key}")
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val
    assert type(attempt) is type(globals()[key]), f"{key}: expected {type(globals()[key]).__name__}"
    print(f"Overriding: {key} = {attempt}")
    globals()[key] = attempt
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    import torch.distributed
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(seed + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
data = torch.randint(vocab_size, (20_000,), generator=torch.Generator().manual_seed(0))
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split):
    source = train_data if split == "train" else val_data
    ix = torch.randint(len(source) - block_size, (batch_size,))
    x = torch.stack([source[i : i + block_size] for i in ix])
    y = torch.stack([source[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            if use_checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, lr):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


model = GPT().to(device)
ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
optimizer = model.configure_optimizers(0.1, learning_rate)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
raw_model = model.module if ddp else model
best_val_loss = float("inf")


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    return learning_rate * 0.5 * (1.0 + math.cos(math.pi * it / max_iters))


X, Y = get_batch("train")
for iter_num in range(max_iters + 1):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss and iter_num > 0:
            best_val_loss = losses["val"]
            checkpoint_state = {"model": raw_model.state_dict(), "iter_num": iter_num}
    if iter_num == max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # nanoGPT: gradients are synchronised on the last micro-step only
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
if ddp:
    torch.distributed.destroy_process_group()
