"""Holds `argv[1]` MiB on the device without any training step."""

import sys

import torch

held = torch.zeros(int(sys.argv[1]) * 1024 * 1024 // 4)
print("holding", held.numel() * 4, "bytes")
