"""The blocks activation checkpointing would wrap: repeated children of one
class in a model's nn.ModuleList / nn.Sequential containers (the snapshot's
`repeated_blocks`, and the targets of the replayed checkpointing fix)."""

from __future__ import annotations

import torch.nn as nn


def repeated_blocks(model: nn.Module) -> list[dict]:
    """The blocks activation checkpointing would wrap, for the snapshot."""
    return [
        {"path": path or "(root)", "class": class_name, "count": len(blocks)}
        for path, _container, class_name, blocks, _composite in checkpoint_targets(model)
    ]


def checkpoint_targets(model: nn.Module) -> list[tuple[str, nn.Module, str, list[nn.Module], bool]]:
    """(path, container, block class, blocks, composite) for the outermost
    nn.ModuleList / nn.Sequential containers holding several children of one
    class: the blocks activation checkpointing wraps. `composite` blocks have
    children of their own (a transformer block); leaf blocks (a Linear in a
    Sequential) are checkpointed in segments with the modules that follow them."""
    found = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[nn.Module]] = {}
        for child in container.children():
            if any(True for _ in child.parameters()):
                groups.setdefault(type(child), []).append(child)
        for block_class, blocks in groups.items():
            if len(blocks) >= 2:
                composite = any(True for _ in blocks[0].children())
                if composite or isinstance(container, nn.Sequential):
                    found.append((path, container, block_class.__name__, blocks, composite))
    chosen: list = []
    for target in sorted(
        found, key=lambda item: (item[0].count(".") if item[0] else -1, not item[4])
    ):
        path = target[0]
        if any(
            other == "" or path == other or path.startswith(other + ".") for other, *_ in chosen
        ):
            continue
        chosen.append(target)
    return chosen
