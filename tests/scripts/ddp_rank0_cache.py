"""A tiny DDP trainer (gloo on the CPU, NCCL with --device cuda) for oomdoc's
distributed tests; run it with torchrun.

Every step each rank trains on its own batch, then averages the loss with an
all_reduce for logging. With --rank0-cache MIB, rank 0 alone keeps MIB of
"evaluation outputs" per step on the device (a history that only rank 0
logs): on a small simulated device rank 0 runs out of memory while rank 1
waits for it in the next all_reduce. Without it the ranks stay balanced.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument(
        "--rank0-cache", type=float, default=0.0, help="MiB kept per step on rank 0"
    )
    parser.add_argument(
        "--rank0-stall",
        type=float,
        default=0.0,
        help="rank 0 sleeps this long before step 1's all_reduce",
    )
    parser.add_argument(
        "--rank0-final-stall",
        type=float,
        default=0.0,
        help="after the last step rank 0 alone works this long (a final evaluation or save)",
    )
    parser.add_argument(
        "--rank1-ignores-sigterm",
        action="store_true",
        help="rank 1 ignores SIGTERM and outlives its peer",
    )
    parser.add_argument(
        "--expect-world", type=int, default=None, help="fail unless this world size"
    )
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, GPU LOCAL_RANK)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    args = parser.parse_args()

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.expect_world is not None and dist.get_world_size() != args.expect_world:
        raise SystemExit(f"world size {dist.get_world_size()}, expected {args.expect_world}")
    torch.manual_seed(0)
    if args.fsdp:  # the fsdp fix, by hand
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        model = Net(args.width, args.depth).to(device)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(
            Net(args.width, args.depth).to(device),
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator(device).manual_seed(rank)
    history = []
    if rank == 1 and args.rank1_ignores_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.width, generator=generator, device=device)
        y = torch.randint(0, 10, (args.batch_size,), generator=generator, device=device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and args.rank0_cache:
            # "Evaluation outputs" kept for logging, on rank 0 only.
            history.append(torch.ones(int(args.rank0_cache * 2**20) // 4, device=device))
        logged = loss.detach().clone()
        if step == 1 and rank == 0 and args.rank0_stall:
            time.sleep(args.rank0_stall)  # rank 1 waits in the all_reduce below
        try:
            dist.all_reduce(logged)
        except RuntimeError:  # the peer died (gloo says so; NCCL would wait)
            while args.rank1_ignores_sigterm:
                time.sleep(0.1)  # a rank that only SIGKILL ends
            raise
        if rank == 0:
            print(f"step {step}: loss {logged.item() / dist.get_world_size():.4f}", flush=True)
    if rank == 0 and args.rank0_final_stall:
        time.sleep(args.rank0_final_stall)  # rank 1 has ended by now
    if os.environ.get("OOMDOC_TEST_SAY_WORLD"):
        print(f"rank {rank} of {dist.get_world_size()} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
