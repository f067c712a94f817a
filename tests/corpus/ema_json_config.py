"""A research-repo idiom: every hyperparameter in a JSON config file
(`--config cfg.json`), an EMA of the weights kept beside the model
(torch.optim.swa_utils.AveragedModel, as timm's ModelEmaV2 and YOLO's
ModelEMA keep a copy) and evaluated each epoch in its place. The model has
BatchNorm buffers and a frozen input projection (not in the optimizer)."""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, dim: int, depth: int, classes: int = 10):
        super().__init__()
        self.project = nn.Linear(dim, dim)
        self.project.requires_grad_(False)  # frozen: never in the optimizer
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.project(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    with open(args.config) as handle:
        cfg = json.load(handle)
    torch.manual_seed(cfg.get("seed", 0))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(cfg["samples"], cfg["dim"])
    y = torch.randint(0, 10, (cfg["samples"],))
    train = DataLoader(
        TensorDataset(x, y), batch_size=cfg["batch_size"], shuffle=True, drop_last=True
    )
    val = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=cfg["batch_size"])
    model = Net(cfg["dim"], cfg["depth"]).to(device)
    ema = (
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg["ema_decay"]))
        if cfg["ema"]
        else None
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"])
    for epoch in range(cfg["epochs"]):
        model.train()
        for step, (xb, yb) in enumerate(train):
            xb, yb = xb.to(device), yb.to(device)
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if ema is not None:
                ema.update_parameters(model)
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}")
        evaluated = ema if ema is not None else model
        evaluated.eval()
        correct = 0
        with torch.no_grad():
            for xb, yb in val:
                correct += (evaluated(xb.to(device)).argmax(-1) == yb.to(device)).sum().item()
        print(f"epoch {epoch} accuracy {correct / 256:.3f}")


if __name__ == "__main__":
    main()
