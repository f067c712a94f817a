"""A trainer that writes as it trains, the way most do: a new versioned run
folder each run (Lightning's `lightning_logs/version_N`, TensorBoard's
runs), a log appended to across runs, the latest weights saved atomically
(`torch.save` to a temporary name, then `os.replace`), a checkpoint per step
with the oldest removed, and a metrics file rewritten at each step.

    python writes_as_it_trains.py --batch-size 4096 --out out
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def next_version(root):
    os.makedirs(root, exist_ok=True)
    taken = [int(name.split("_")[1]) for name in os.listdir(root) if name.startswith("version_")]
    return os.path.join(root, f"version_{max(taken, default=-1) + 1}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept per run")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()

    run_dir = next_version(os.path.join(args.out, "runs"))
    os.makedirs(run_dir)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with open(os.path.join(args.out, "train.log"), "a") as log:
        for step in range(args.steps):
            x = torch.randn(args.batch_size, 32)
            y = torch.randint(0, 10, (args.batch_size,))
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(f"{run_dir} step {step}: loss {loss.item():.4f}\n")
            log.flush()
            latest = os.path.join(args.out, "last.pt")
            torch.save(model.state_dict(), latest + ".tmp")
            os.replace(latest + ".tmp", latest)
            torch.save(model.state_dict(), os.path.join(run_dir, f"step-{step}.pt"))
            oldest = os.path.join(run_dir, f"step-{step - args.keep}.pt")
            if os.path.exists(oldest):
                os.remove(oldest)
            with open(os.path.join(args.out, "metrics.json"), "w") as metrics:
                json.dump({"run": run_dir, "step": step, "loss": loss.item()}, metrics)


if __name__ == "__main__":
    main()
