"""A trainer in the nanoGPT idiom: the configuration is module globals,
overridden by `configurator.py` (exec'd over them) from `--key=value`
options and configuration files given as positionals; the loop accumulates
gradients over `gradient_accumulation_steps` micro-batches itself. Small,
for the simulated device.

    python train.py config/tiny.py --batch_size=12 --gradient_accumulation_steps=2
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# default config values
batch_size = 12  # micro-batch size
block_size = 32
vocab_size = 64
n_embd = 32
gradient_accumulation_steps = 2
max_iters = 3
learning_rate = 1e-3
compile = False
# -----------------------------------------------------------------------------
here = os.path.dirname(os.path.abspath(__file__))
exec(open(os.path.join(here, "configurator.py")).read())  # overrides from the command line
# -----------------------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.proj(F.gelu(self.fc(x)))
        return self.head(x)


torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
# A small fixed pool of sequences: the data costs the same whatever the batch.
pool = torch.randint(vocab_size, (64, block_size + 1))


def get_batch(step):
    rows = (torch.arange(batch_size) + step) % pool.shape[0]
    return pool[rows, :-1], pool[rows, 1:]


for iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        x, y = get_batch(iter_num * gradient_accumulation_steps + micro_step)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, vocab_size), y.reshape(-1))
        loss = loss / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}", flush=True)
