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
            0,
            0,
            ("other",),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py",
        ),
        FixInfo(
            "empty_cache",
            "Return cached blocks to the driver between steps",
            0,
            1,
            ("other",),
            "optimizer.step()\noptimizer.zero_grad(set_to_none=True)\ntorch.cuda.empty_cache()",
        ),
        FixInfo(
            "checkpointing",
            "Activation checkpointing of the repeated blocks",
            0,
            1,
            ("activations",),
            "from torch.utils.checkpoint import checkpoint\n"
            "for block in model.blocks:\n"
            "    x = checkpoint(block, x, use_reentrant=False)",
        ),
        FixInfo(
            "autocast",
            "Mixed precision with torch.autocast",
            1,
            0,
            ("activations",),
            "with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(inputs), targets)\n"
            "loss.backward()",
        ),
        FixInfo(
            "lighter_optimizer",
            "An optimizer with less state per parameter",
            2,
            0,
            ("optimizer_state",),
            "optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\n"
            "# or torch.optim.Adafactor(model.parameters(), lr=lr) (torch>=2.5), or bitsandbytes' 8-bit AdamW",
        ),
        FixInfo(
            "smaller_batch",
            "A smaller batch, with gradient accumulation to keep the effective batch",
            2,
            1,
            ("activations",),
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


# The fixes a replay can measure, in the order they are tried.
REPLAYABLE = (
    "smaller_batch",
    "autocast",
    "checkpointing",
    "empty_cache",
    "expandable_segments",
    "lighter_optimizer",
)
CUDA_ONLY = ("empty_cache", "expandable_segments")


def combination_parts(name: str) -> list[str] | None:
    """The parts of a valid combination name `a+b`, or None."""
    parts = name.split("+")
    if len(parts) != 2 or not all(part in FIXES for part in parts) or parts[0] == parts[1]:
        return None
    if frozenset(parts) not in COMPATIBLE_PAIRS:
        return None
    return parts


def render_snippet(name: str, context: dict | None = None) -> str:
    """The catalogue snippet, made concrete with what the replay learned
    (device and dtype for autocast, the blocks' path for checkpointing, the
    batch sizes for a smaller batch, the optimizer measured)."""
    context = context or {}
    parts = name.split("+")
    if len(parts) > 1:
        return "\n\n".join(f"# {part}\n{render_snippet(part, context)}" for part in parts)
    if name == "autocast":
        device_type = context.get("device_type", "cuda")
        dtype = context.get("dtype", "bfloat16")
        snippet = (
            f"with torch.autocast(device_type={device_type!r}, dtype=torch.{dtype}):\n"
            "    loss = loss_fn(model(inputs), targets)\n"
        )
        if dtype == "float16":
            return (
                "scaler = torch.amp.GradScaler()  # float16 needs loss scaling\n"
                + snippet
                + "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"
            )
        return snippet + "loss.backward()"
    if name == "checkpointing" and context.get("blocks_path"):
        path = context["blocks_path"]
        return (
            "from torch.utils.checkpoint import checkpoint\n"
            f"for block in model.{path}:  # {context.get('blocks_class', 'block')} x {context.get('blocks_count', '?')}\n"
            "    x = checkpoint(block, x, use_reentrant=False)"
        )
    if name == "smaller_batch" and context.get("micro_batch"):
        micro, steps = context["micro_batch"], context["accumulation_steps"]
        how = context.get("how", "batch_size")
        return (
            f"# {how} {micro}: {steps} micro-batches of {micro} keep the effective batch at {micro * steps}\n"
            f"accumulation_steps = {steps}\n"
            "for i, (x, y) in enumerate(loader):\n"
            "    loss = loss_fn(model(x), y) / accumulation_steps\n"
            "    loss.backward()\n"
            "    if (i + 1) % accumulation_steps == 0:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad(set_to_none=True)"
        )
    if name == "lighter_optimizer" and context.get("optimizer") == "Adafactor":
        return (
            "optimizer = torch.optim.Adafactor(model.parameters(), lr=lr)  # factored second moments\n"
            "# or torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9): one tensor of state per parameter"
        )
    info = FIXES.get(name)
    return info.snippet if info else ""


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
