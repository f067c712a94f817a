"""accelerate's `notebook_launcher`, as a notebook's last cell calls it: the
training function builds its own `Accelerator` and the launcher starts one
process per rank (torch's elastic agent, forked), here on the CPU.

    python launch_notebook.py --batch-size 512 --port 29517   # OOMs under oomdoc on 6MiB
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, notebook_launcher
from torch.utils.data import DataLoader, TensorDataset


def training_function(batch_size, steps):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A small fixed pool: the dataset's memory does not grow with the batch.
    features = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(features.repeat(steps * batch_size // 256 + 1, 1)[: steps * batch_size])
    loader = DataLoader(data, batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for (batch,) in loader:
        loss = F.cross_entropy(model(batch), torch.zeros(len(batch), dtype=torch.long))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print("done")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--port", default="29500")
    args = parser.parse_args()
    # Tiny ops: one thread is much faster than two contending ones on a busy CI machine.
    torch.set_num_threads(1)
    notebook_launcher(
        training_function,
        (args.batch_size, args.steps),
        num_processes=args.processes,
        use_port=args.port,
    )
