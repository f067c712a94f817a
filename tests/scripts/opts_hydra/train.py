"""A trainer in Hydra's idiom, for the script-options tests: `@hydra.main`
over `configs/train.yaml`, options given as overrides with no dashes.

    python train.py data.batch_size=512     # OOMs under oomdoc on 4MiB
    python train.py data.batch_size=256 trainer.accumulate_grad_batches=2

Hydra catches the job's error, prints it and exits with status 1; it writes
its logs under `outputs/` in the working directory.
"""

import hydra
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset


def build_model(cfg: DictConfig) -> nn.Module:
    layers = [nn.Linear(cfg.data.features, cfg.model.width)]
    for _ in range(cfg.model.depth):
        layers += [nn.ReLU(), nn.Linear(cfg.model.width, cfg.model.width)]
    return nn.Sequential(*layers, nn.Linear(cfg.model.width, cfg.data.classes))


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    features = torch.randn(cfg.data.samples, cfg.data.features)
    labels = torch.randint(0, cfg.data.classes, (cfg.data.samples,))
    loader = DataLoader(TensorDataset(features, labels), batch_size=cfg.data.batch_size)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    accumulate = cfg.trainer.accumulate_grad_batches
    step = 0
    while step < cfg.trainer.max_steps:
        for index, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / accumulate
            loss.backward()
            if (index + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step >= cfg.trainer.max_steps:
                    break
    print(f"trained {step} steps")


if __name__ == "__main__":
    main()
