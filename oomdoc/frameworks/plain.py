"""A plain PyTorch loop: the fixes written as torch code (the catalogue's
snippets, unchanged), and the script's own argparse flags where it has them."""

from __future__ import annotations

from oomdoc.fixes import fix_named
from oomdoc.fixes.smaller_batch import update_lines
from oomdoc.frameworks.base import (
    EXPANDABLE_ENV,
    Framework,
    FrameworkContext,
    effective_batch_comment,
)


def catalogue_snippet(fix: str, context: FrameworkContext) -> str:
    """The fix as plain torch code: the fix unit's own snippet (oomdoc.fixes)."""
    unit = fix_named(fix)
    return unit.snippet(context) if unit is not None else ""


class _DefaultSnippets:
    """`DEFAULT_SNIPPETS[fix]`: the catalogue's snippet without context."""

    def __getitem__(self, fix: str) -> str:
        return catalogue_snippet(fix, {})

    def get(self, fix: str, default: str = "") -> str:
        return catalogue_snippet(fix, {}) or default


DEFAULT_SNIPPETS = _DefaultSnippets()


def autocast_snippet(context: FrameworkContext) -> str:
    return catalogue_snippet("autocast", context)


def checkpointing_snippet(context: FrameworkContext, owner: str = "model") -> str | None:
    """Checkpointing of the measured blocks, `owner.path`; None without them."""
    if not context.get("blocks_path"):
        return None
    return catalogue_snippet("checkpointing", {**context, "owner": owner})


def lighter_optimizer_snippet(
    context: FrameworkContext, parameters: str = "model.parameters()"
) -> str | None:
    if context.get("optimizer") != "Adafactor":
        return None
    return catalogue_snippet("lighter_optimizer", {**context, "parameters": parameters})


class Plain(Framework):
    name = "plain"
    label = "a plain PyTorch loop"

    def snippet(self, fix: str, context: FrameworkContext) -> str:
        parts = fix.split("+")
        if len(parts) > 1:
            return "\n\n".join(f"# {part}\n{self.snippet(part, context)}" for part in parts)
        if fix == "smaller_batch":
            # A script with its own accumulation option needs no loop change.
            own = self.command_with_flags([fix], context)
            if own is not None:
                micro, steps = context.get("micro_batch"), context.get("accumulation_steps")
                return (
                    f"# with your script's own options: micro-batches of {micro} and "
                    f"{steps} times the accumulation keep the effective batch\n{own}"
                )
        return catalogue_snippet(fix, context)

    def prescription_snippet(self, fixes: list[str], context: FrameworkContext) -> str:
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
        # GradScaler steps an optimizer: a script updating by hand goes without.
        scaled = (
            "autocast" in fixes
            and context.get("dtype") == "float16"
            and context.get("update") != "manual"
        )
        if scaled:
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
        loop.append("    scaler.scale(loss).backward()" if scaled else "    loss.backward()")
        indent = "    "
        if accumulate:
            loop.append("    if (i + 1) % accumulation_steps == 0:")
            indent = "        "
        loop += update_lines(context, indent, scaled)
        if "empty_cache" in fixes:
            loop.append(f"{indent}torch.cuda.empty_cache()")
        lines.append("\n".join(loop))
        own_flags = self.own_flags_block(fixes, context, "or with your script's own flags")
        if own_flags:
            lines.append(own_flags)
        return "\n\n".join(lines)
