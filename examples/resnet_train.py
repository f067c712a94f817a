"""Train torchvision's ResNet-50 on random images: a reference workload for
oomdoc on a GPU (torchvision is needed; it is not a dependency of oomdoc).

    python examples/resnet_train.py --batch-size 256 --steps 20
    oomdoc run --device-memory 16GiB examples/resnet_train.py --batch-size 512

--autocast and --checkpointing apply those fixes by hand, so that what
oomdoc's replays measure can be checked against the script itself.
Prints the median step time of the steps after the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint each bottleneck block")
    args = parser.parse_args()

    import torchvision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    if args.checkpointing:
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            for block in stage:
                forward = block.forward
                block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    times = []
    for _step in range(args.steps):
        started = time.perf_counter()
        with torch.autocast(device_type=device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # waits for the GPU
        times.append(time.perf_counter() - started)
    steady = times[1:] or times
    print(f"median step {statistics.median(steady) * 1000:.1f} ms, {args.batch_size / statistics.median(steady):.1f} samples/s")
    if device == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated()} bytes")


if __name__ == "__main__":
    main()
