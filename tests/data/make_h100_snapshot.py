"""How tests/data/h100_oom_snapshot.pickle was made (on an H100, torch 2.11).

A small MLP training loop on a card capped to 1 GiB with allocation history
on; the OOM observer dumps PyTorch's own snapshot at the moment of the OOM,
exactly as PyTorch's "Understanding CUDA Memory Usage" page describes.

    python tests/data/make_h100_snapshot.py OUT.pickle
"""

import sys

import torch
import torch.nn as nn


def main(path: str) -> None:
    torch.cuda.set_per_process_memory_fraction(1024**3 / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.memory._record_memory_history(max_entries=3000)

    def dump_on_oom(device, requested, device_allocated, device_free):
        torch.cuda.memory._dump_snapshot(path)

    torch._C._cuda_attach_out_of_memory_observer(dump_on_oom)
    model = nn.Sequential(nn.Linear(2048, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = 256
    try:
        while True:
            x = torch.randn(batch, 2048, device="cuda")
            y = torch.randint(0, 10, (batch,), device="cuda")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            batch *= 2
    except torch.OutOfMemoryError as exc:
        print(f"OOM at batch {batch}: {str(exc).splitlines()[0][:200]}")


if __name__ == "__main__":
    main(sys.argv[1])
