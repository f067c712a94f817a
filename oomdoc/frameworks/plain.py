"""A plain PyTorch loop: the fixes written as torch code (the catalogue's
snippets, unchanged), and the script's own argparse flags where it has them."""

from __future__ import annotations

from oomdoc.frameworks.base import EXPANDABLE_ENV, Framework, effective_batch_comment

# The catalogue's snippets (oomdoc.fixes), kept here word for word so that this
# package needs nothing from the fix catalogue (whose fix objects call it).
DEFAULT_SNIPPETS = {
    "expandable_segments": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py",
    "empty_cache": "optimizer.step()\noptimizer.zero_grad(set_to_none=True)\ntorch.cuda.empty_cache()",
    "checkpointing": "from torch.utils.checkpoint import checkpoint\n"
    "for block in model.blocks:\n"
    "    x = checkpoint(block, x, use_reentrant=False)",
    "autocast": "with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n"
    "    loss = loss_fn(model(inputs), targets)\n"
    "loss.backward()",
    "lighter_optimizer": "optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\n"
    "# or torch.optim.Adafactor(model.parameters(), lr=lr) (torch>=2.5), or bitsandbytes' 8-bit AdamW",
    "smaller_batch": "accumulation_steps = 2  # effective batch = batch_size * accumulation_steps\n"
    "for i, (x, y) in enumerate(loader):\n"
    "    loss = loss_fn(model(x), y) / accumulation_steps\n"
    "    loss.backward()\n"
    "    if (i + 1) % accumulation_steps == 0:\n"
    "        optimizer.step()\n"
    "        optimizer.zero_grad(set_to_none=True)",
}


def autocast_snippet(context: dict) -> str:
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


def checkpointing_snippet(context: dict, owner: str = "model") -> str | None:
    """Checkpointing of the measured blocks, `owner.path`; None without them."""
    path = context.get("blocks_path")
    if not path:
        return None
    return (
        "from torch.utils.checkpoint import checkpoint\n"
        f"for block in {owner}.{path}:  # {context.get('blocks_class', 'block')} x {context.get('blocks_count', '?')}\n"
        "    x = checkpoint(block, x, use_reentrant=False)"
    )


def lighter_optimizer_snippet(context: dict, parameters: str = "model.parameters()") -> str | None:
    if context.get("optimizer") != "Adafactor":
        return None
    return (
        f"optimizer = torch.optim.Adafactor({parameters}, lr=lr)  # factored second moments\n"
        f"# or torch.optim.SGD({parameters}, lr=lr, momentum=0.9): one tensor of state per parameter"
    )


class Plain(Framework):
    name = "plain"
    label = "a plain PyTorch loop"

    def snippet(self, fix: str, context: dict) -> str:
        parts = fix.split("+")
        if len(parts) > 1:
            return "\n\n".join(f"# {part}\n{self.snippet(part, context)}" for part in parts)
        if fix == "autocast":
            return autocast_snippet(context)
        if fix == "checkpointing" and context.get("blocks_path"):
            return checkpointing_snippet(context) or ""
        if fix == "smaller_batch" and context.get("micro_batch"):
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
        if fix == "lighter_optimizer" and context.get("optimizer") == "Adafactor":
            return lighter_optimizer_snippet(context) or ""
        return DEFAULT_SNIPPETS.get(fix, "")

    def prescription_snippet(self, fixes: list[str], context: dict) -> str:
        """One training loop with every fix in it."""
        fixes = [part for fix in fixes for part in fix.split("+")]
        lines = []
        if "expandable_segments" in fixes:
            lines.append(f"# run with {EXPANDABLE_ENV}")
        if "lighter_optimizer" in fixes:
            lines.append(
                lighter_optimizer_snippet({"optimizer": "Adafactor", **context})
                or DEFAULT_SNIPPETS["lighter_optimizer"]
            )
        if "checkpointing" in fixes:
            lines.append(
                "# in the model's forward:\n"
                + (checkpointing_snippet(context) or DEFAULT_SNIPPETS["checkpointing"])
            )
        accumulate = "smaller_batch" in fixes
        steps = context.get("accumulation_steps") or 2
        loop = []
        if accumulate:
            comment = effective_batch_comment(context)
            micro = context.get("micro_batch")
            loop.append(
                f"accumulation_steps = {steps}"
                + (f"  # batch size {micro}: {comment}" if comment else "")
            )
        if "autocast" in fixes and context.get("dtype") == "float16":
            loop.append("scaler = torch.amp.GradScaler()  # float16 needs loss scaling")
        loop.append("for i, (x, y) in enumerate(loader):")
        body = "loss = loss_fn(model(x), y)" + (" / accumulation_steps" if accumulate else "")
        if "autocast" in fixes:
            device_type = context.get("device_type", "cuda")
            dtype = context.get("dtype", "bfloat16")
            loop.append(
                f"    with torch.autocast(device_type={device_type!r}, dtype=torch.{dtype}):"
            )
            loop.append(f"        {body}")
        else:
            loop.append(f"    {body}")
        scaled = "autocast" in fixes and context.get("dtype") == "float16"
        loop.append("    scaler.scale(loss).backward()" if scaled else "    loss.backward()")
        indent = "    "
        if accumulate:
            loop.append("    if (i + 1) % accumulation_steps == 0:")
            indent = "        "
        if scaled:
            loop += [f"{indent}scaler.step(optimizer)", f"{indent}scaler.update()"]
        else:
            loop.append(f"{indent}optimizer.step()")
        loop.append(f"{indent}optimizer.zero_grad(set_to_none=True)")
        if "empty_cache" in fixes:
            loop.append(f"{indent}torch.cuda.empty_cache()")
        lines.append("\n".join(loop))
        own_flags = self.own_flags_block(fixes, context, "or with your script's own flags")
        if own_flags:
            lines.append(own_flags)
        return "\n\n".join(lines)
