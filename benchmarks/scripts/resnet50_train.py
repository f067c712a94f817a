"""torchvision's ResNet-50 on random images: many small modules and tensors.

    python resnet50_train.py --batch-size 128 --steps 40        # GPU

SGD with momentum, random 224x224 images (no downloads; the model is built
untrained). Prints `step N: loss L (T ms, cpu C ms)` per step, after reading
the loss (which waits for the GPU).
"""

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    model.train()
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        loss = F.cross_entropy(model(images), labels)
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
