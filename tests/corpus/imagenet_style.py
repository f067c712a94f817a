"""An image-classification trainer in the idiom of pytorch/examples' ImageNet
script, small enough for the simulated device.

    python imagenet_style.py -b 64 -j 2 --epochs 1

What makes it a real-idiom script rather than one shaped for oomdoc:
- argparse with short flags (`-b`, `-j`, `-e`) and `--multiprocessing-distributed`
  (one process per device started with `torch.multiprocessing.spawn`);
- the transforms are `nn.Module`s called per sample by the dataset (in the
  DataLoader's workers with `-j N`, in the main process with `-j 0`);
- the loss is a module, `nn.CrossEntropyLoss().to(device)`;
- `--amp`, `--checkpoint` and `--grad-accum-steps` as torchvision's and timm's
  references have them (what oomdoc's prescriptions are checked with by hand);
- a validation pass under `torch.no_grad()` with `model.eval()` after each
  epoch (or alone with `-e`), at its own batch size (`--val-batch-size`).
"""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser(description="PyTorch ImageNet-style Training")
parser.add_argument("-j", "--workers", default=0, type=int, metavar="N")
parser.add_argument("--epochs", default=1, type=int, metavar="N")
parser.add_argument("-b", "--batch-size", default=64, type=int, metavar="N")
parser.add_argument("--val-batch-size", default=None, type=int, metavar="N")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true")
parser.add_argument("--image-size", default=32, type=int)
parser.add_argument("--width", default=16, type=int)
parser.add_argument("--train-samples", default=256, type=int)
parser.add_argument("--val-samples", default=128, type=int)
parser.add_argument("--world-size", default=1, type=int)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:29517", type=str)
parser.add_argument("--dist-backend", default="gloo", type=str)
parser.add_argument("--multiprocessing-distributed", action="store_true")
parser.add_argument("--seed", default=0, type=int)
# As torchvision's and timm's training references have them:
parser.add_argument("--amp", action="store_true", help="bf16 autocast")
parser.add_argument("--checkpoint", action="store_true", help="checkpoint each residual block")
parser.add_argument("--grad-accum-steps", default=1, type=int)


class RandomHorizontalFlip(nn.Module):
    def forward(self, image):
        return image.flip(-1) if torch.rand(()) < 0.5 else image


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1))

    def forward(self, image):
        return (image - self.mean) / self.std


class FakeImages(Dataset):
    """Deterministic fake images (sample i is always the same), like torchvision's FakeData."""

    def __init__(self, size, image_size, classes, transform):
        self.size, self.image_size, self.classes, self.transform = (
            size,
            image_size,
            classes,
            transform,
        )

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        image = torch.rand(3, self.image_size, self.image_size, generator=generator)
        return self.transform(image), index % self.classes


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, stride)
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        return torch.relu(self.conv2(self.conv1(x)) + self.shortcut(x))


class ResNetLike(nn.Module):
    def __init__(self, width, classes=10, checkpointing=False):
        super().__init__()
        self.checkpointing = checkpointing
        self.stem = conv_bn(3, width)
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1)
        )
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in [*self.layer1, *self.layer2]:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def main():
    args = parser.parse_args()
    if args.multiprocessing_distributed:
        mp.spawn(main_worker, nprocs=args.world_size, args=(args,))
    else:
        main_worker(0, args)


def main_worker(rank, args):
    distributed = args.multiprocessing_distributed
    if distributed:
        dist.init_process_group(
            args.dist_backend, init_method=args.dist_url, world_size=args.world_size, rank=rank
        )
    torch.manual_seed(args.seed)
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    model = ResNetLike(args.width, checkpointing=args.checkpoint).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.type == "cuda" else None
        )
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    normalize = Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = FakeImages(
        args.train_samples, args.image_size, 10, nn.Sequential(RandomHorizontalFlip(), normalize)
    )
    val_dataset = FakeImages(args.val_samples, args.image_size, 10, normalize)
    sampler = (
        torch.utils.data.distributed.DistributedSampler(train_dataset) if distributed else None
    )
    train_loader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        num_workers=args.workers,
        sampler=sampler,
    )
    val_loader = DataLoader(
        val_dataset, batch_size=args.val_batch_size or args.batch_size, num_workers=args.workers
    )
    if args.evaluate:
        validate(val_loader, model, criterion, device, args)
        return
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, device, args)
        if rank == 0:
            print(f"epoch {epoch}: acc@1 {acc1:.2f}")
    if distributed:
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    model.train()
    accumulation = args.grad_accum_steps
    for i, (images, target) in enumerate(train_loader):
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target) / accumulation
        loss.backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
        if i % 4 == 0:
            print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f}")


def validate(val_loader, model, criterion, device, args):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, target in val_loader:
            images, target = (
                images.to(device, non_blocking=True),
                target.to(device, non_blocking=True),
            )
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                output = model(images)
                loss = criterion(output, target)
            correct += (output.argmax(1) == target).sum().item()
            total += target.numel()
    del loss
    return 100.0 * correct / max(total, 1)


if __name__ == "__main__":
    main()
