"""A training loop that hands its forward and backward to `optimizer.step(closure)`,
as Lightning's automatic optimization and LBFGS do.

    python closure_loop.py --optimizer adamw --steps 3
    python closure_loop.py --optimizer lbfgs --steps 2          # the closure runs several times a step
    python closure_loop.py --optimizer sgd --positional         # optimizer.step(closure), not closure=
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", choices=["sgd", "adamw", "lbfgs"], default="adamw")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--positional", action="store_true", help="pass the closure positionally")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
)
optimizer = {
    "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
    "lbfgs": lambda: torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3, history_size=2),
}[args.optimizer]()
inputs = torch.randn(args.batch_size, 256)
targets = torch.randint(0, 10, (args.batch_size,))


def closure():
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    return loss


for step in range(args.steps):
    loss = optimizer.step(closure) if args.positional else optimizer.step(closure=closure)
    print(f"step {step}: loss {loss.item():.4f}", flush=True)
