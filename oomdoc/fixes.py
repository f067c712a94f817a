"""The catalogue of fixes: names, what each costs, and how to apply it by hand.

Replays measure these; `oomdoc suggest` estimates them from a breakdown when no
measurement exists. Both take names, snippets and costs from here so a fix
reads the same wherever it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixInfo:
    name: str
    title: str
    # Lower is cheaper. Ranking puts fixes that fit first, then the smaller
    # cost to training semantics, then to speed, then the larger saving.
    semantics_cost: int  # 0: none, 1: numerics change, 2: optimisation changes
    speed_cost: int  # 0: none expected, 1: some recompute or overhead
    addresses: tuple[str, ...]  # breakdown categories it shrinks
    snippet: str


FIXES: dict[str, FixInfo] = {
    fix.name: fix
    for fix in (
        FixInfo(
            "expandable_segments",
            "Let the CUDA allocator grow segments instead of splitting them",
            0, 0, ("other",),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py",
        ),
        FixInfo(
            "empty_cache",
            "Return cached blocks to the driver between steps",
            0, 1, ("other",),
            "optimizer.step()\noptimizer.zero_grad(set_to_none=True)\ntorch.cuda.empty_cache()",
        ),
        FixInfo(
            "checkpointing",
            "Activation checkpointing of the repeated blocks",
            0, 1, ("activations",),
            "from torch.utils.checkpoint import checkpoint\n"
            "for block in model.blocks:\n"
            "    x = checkpoint(block, x, use_reentrant=False)",
        ),
        FixInfo(
            "autocast",
            "Mixed precision with torch.autocast",
            1, 0, ("activations",),
            "with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(inputs), targets)\n"
            "loss.backward()",
        ),
        FixInfo(
            "lighter_optimizer",
            "An optimizer with less state per parameter",
            2, 0, ("optimizer_state",),
            "optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\n"
            "# or torch.optim.Adafactor(model.parameters(), lr=lr) (torch>=2.5), or bitsandbytes' 8-bit AdamW",
        ),
        FixInfo(
            "smaller_batch",
            "A smaller batch, with gradient accumulation to keep the effective batch",
            2, 1, ("activations",),
            "accumulation_steps = 2  # effective batch = batch_size * accumulation_steps\n"
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accumulation_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accumulation_steps == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad(set_to_none=True)",
        ),
    )
}

# Fixes that can be measured together in one replay.
COMPATIBLE_PAIRS = {
    frozenset(pair)
    for pair in (
        ("autocast", "checkpointing"),
        ("autocast", "lighter_optimizer"),
        ("checkpointing", "lighter_optimizer"),
        ("autocast", "expandable_segments"),
        ("checkpointing", "expandable_segments"),
        ("lighter_optimizer", "expandable_segments"),
        ("autocast", "empty_cache"),
        ("checkpointing", "empty_cache"),
        ("smaller_batch", "autocast"),
        ("smaller_batch", "checkpointing"),
    )
}


def fix_info(name: str) -> FixInfo | None:
    """The catalogue entry for a fix, or for `a+b` the cheaper part's costs."""
    if name in FIXES:
        return FIXES[name]
    parts = name.split("+")
    if len(parts) > 1 and all(part in FIXES for part in parts):
        infos = [FIXES[part] for part in parts]
        return FixInfo(
            name,
            " + ".join(info.title for info in infos),
            max(info.semantics_cost for info in infos),
            max(info.speed_cost for info in infos),
            tuple(sorted({c for info in infos for c in info.addresses})),
            "\n\n".join(f"# {info.name}\n{info.snippet}" for info in infos),
        )
    return None
