"""torchvision's ResNet-50 on random images: many small modules and tensors.

    python resnet50_train.py --batch-size 128 --steps 40        # GPU
    python resnet50_train.py --batch-size 128 --accumulation-steps 4   # effective batch 512

SGD with momentum, random 224x224 images (no downloads; the model is built
untrained). Prints `step N: loss L (T ms, cpu C ms)` per step, after reading
the loss (which waits for the GPU).
"""

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.checkpoint import checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=224)
    # The fixes by hand, to check what oomdoc's replays measured and prescribed.
    parser.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint each bottleneck")
    parser.add_argument(
        "--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    if args.checkpointing:
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            for block in stage:
                block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    model.train()
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        # The gradients are dropped after the first micro-batch's forward (as
        # before accumulation existed here), so later micro-batches run their
        # forward with the accumulated gradients alive, as accumulation does.
        for micro_batch in range(args.accumulation_steps):
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels) / args.accumulation_steps
            if micro_batch == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        loss_value = loss.item()  # waits for the GPU
        now, now_cpu = time.perf_counter(), time.process_time()
        print(
            f"step {step}: loss {loss_value:.4f} ({1000 * (now - last):.3f} ms, "
            f"cpu {1000 * (now_cpu - last_cpu):.3f} ms)",
            flush=True,
        )
        last, last_cpu = now, now_cpu


if __name__ == "__main__":
    main()
