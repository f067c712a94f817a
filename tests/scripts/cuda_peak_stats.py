"""A small CUDA training loop that reads the allocator's peak statistics the
way a script does, for tests/gpu/test_peak_view_gpu.py: run plainly and under
`oomdoc run`, it must read the same numbers. Writes them as JSON to argv[1].

Deterministic in what it allocates: fixed seeds, one batch of fixed shape,
plain SGD (no optimizer state, no temporaries in its step: the peak of a step
is in its forward and backward passes).
"""

import json
import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
device = torch.device("cuda")
widths = (1024, 2048, 2048, 2048)
layers: list = []
for width_in, width_out in zip(widths, widths[1:]):
    layers += [nn.Linear(width_in, width_out), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(widths[-1], 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
inputs = torch.randn(4096, 1024, device=device)
targets = torch.randint(0, 10, (4096,), device=device)
readings = {}


def read(name):
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    readings[name] = {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "allocated_bytes.all.peak": stats["allocated_bytes.all.peak"],
        "reserved_bytes.all.peak": stats["reserved_bytes.all.peak"],
        "active_bytes.all.peak": stats["active_bytes.all.peak"],
        "memory_allocated": torch.cuda.memory_allocated(),
        "memory_reserved": torch.cuda.memory_reserved(),
        "mem_get_info.total": torch.cuda.mem_get_info()[1],
    }
    accelerator = getattr(torch, "accelerator", None)
    if hasattr(accelerator, "max_memory_allocated"):  # torch 2.8 and later
        readings[name]["accelerator.max_memory_allocated"] = accelerator.max_memory_allocated()


def step(reset_after_backward=False):
    loss = nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    if reset_after_backward:
        torch.cuda.reset_peak_memory_stats()  # after the step's peak
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(3):
    step()
read("three_steps")
torch.cuda.reset_peak_memory_stats()
step()
read("after_reset")
step(reset_after_backward=True)
read("reset_after_backward")
with open(sys.argv[1], "w") as handle:
    json.dump(readings, handle, indent=1)
