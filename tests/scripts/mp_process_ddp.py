"""DDP in processes the script starts itself with multiprocessing.Process
(not torch's spawn), beside a data-preparation process that never joins
the process group, as scripts that manage their own workers do.

    python mp_process_ddp.py --batch-size 4096 --start-method fork   # OOMs under oomdoc on 8MiB
    python mp_process_ddp.py --cuda --batch-size 1000000   # NCCL, a GPU per rank: OOMs on 512MiB
"""

import argparse
import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def prepare_data(queue, batch_size, steps):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        queue.put(torch.randn(batch_size, 64, generator=generator).numpy())


def train(rank, world_size, port, batch_size, steps, rank0_final_stall=0.0, cuda=False):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 10))
    model = DistributedDataParallel(layers.to(device), device_ids=[rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        batch = torch.randn(batch_size, 64, device=device)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        time.sleep(rank0_final_stall)  # a final checkpoint: rank 1 has ended by now
    dist.destroy_process_group()


class TrainerProcess(mp.Process):
    """The same rank as a Process subclass (--as-subclass)."""

    def __init__(self, *train_args, **train_kwargs):
        super().__init__()
        self.train_args, self.train_kwargs = train_args, train_kwargs

    def run(self):
        train(*self.train_args, **self.train_kwargs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn")
    parser.add_argument("--rank0-final-stall", type=float, default=0.0, help="seconds")
    parser.add_argument("--as-subclass", action="store_true", help="ranks as TrainerProcess")
    parser.add_argument("--cuda", action="store_true", help="NCCL, GPU `rank` for each rank")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mp.set_start_method(args.start_method)
    queue = mp.Queue()
    data = mp.Process(target=prepare_data, args=(queue, 16, args.steps))
    data.start()
    ranks = []
    for rank in range(args.world_size):
        train_args = (rank, args.world_size, args.port, args.batch_size, args.steps)
        train_kwargs = {"rank0_final_stall": args.rank0_final_stall, "cuda": args.cuda}
        if args.as_subclass:
            ranks.append(TrainerProcess(*train_args, **train_kwargs))
        else:
            ranks.append(mp.Process(target=train, args=train_args, kwargs=train_kwargs))
    for process in ranks:
        process.start()
    for _ in range(args.steps):
        queue.get()
    data.join()
    for process in ranks:
        process.join()
    failed = [process.exitcode for process in ranks if process.exitcode]
    raise SystemExit(1 if failed else 0)
