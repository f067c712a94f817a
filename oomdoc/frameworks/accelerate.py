"""accelerate: `Accelerator(mixed_precision=..., gradient_accumulation_steps=...)`
and `with accelerator.accumulate(model):` around the step."""

from __future__ import annotations

from oomdoc.frameworks.base import (
    EXPANDABLE_ENV,
    Framework,
    FrameworkContext,
    effective_batch_comment,
)
from oomdoc.frameworks.plain import (
    DEFAULT_SNIPPETS,
    checkpointing_snippet,
    lighter_optimizer_snippet,
)

MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def _mixed_precision(context: FrameworkContext) -> str:
    return MIXED_PRECISION.get(context.get("dtype", "bfloat16"), "bf16")


def _accumulation_loop(context: FrameworkContext, empty_cache: bool = False) -> str:
    micro = context.get("micro_batch")
    comment = effective_batch_comment(context)
    lines = [
        f"loader = DataLoader(dataset, batch_size={micro or 'BATCH // 2'}, ...)"
        + (f"  # {comment}" if comment else ""),
        "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)",
        "for x, y in loader:",
        "    with accelerator.accumulate(model):  # steps the optimizer every N batches",
        "        loss = loss_fn(model(x), y)",
        "        accelerator.backward(loss)",
        "        optimizer.step()",
        "        optimizer.zero_grad(set_to_none=True)",
    ]
    if empty_cache:
        lines.append("    torch.cuda.empty_cache()")
    return "\n".join(lines)


class Accelerate(Framework):
    name = "accelerate"
    label = "accelerate"

    def _accelerator(self, fixes: list[str], context: FrameworkContext) -> str:
        arguments = ["..."]
        if "autocast" in fixes:
            arguments.append(f'mixed_precision="{_mixed_precision(context)}"')
        if "smaller_batch" in fixes:
            arguments.append(
                f"gradient_accumulation_steps={context.get('accumulation_steps') or 2}"
            )
        text = f"accelerator = Accelerator({', '.join(arguments)})"
        if "autocast" in fixes and context.get("dtype") == "float16":
            text += "  # no bf16 on this GPU: accelerate scales the loss"
        return text

    def snippet(self, fix: str, context: FrameworkContext) -> str:
        parts = fix.split("+")
        if len(parts) > 1:
            return self.prescription_snippet(parts, context)
        if fix == "autocast":
            return self._accelerator(["autocast"], context)
        if fix == "smaller_batch":
            return (
                self._accelerator(["smaller_batch"], context) + "\n" + _accumulation_loop(context)
            )
        if fix == "checkpointing":
            return (
                checkpointing_snippet(context) or DEFAULT_SNIPPETS["checkpointing"]
            ) + "\n# a Hugging Face model: model.gradient_checkpointing_enable()"
        if fix == "lighter_optimizer":
            return lighter_optimizer_snippet(context) or DEFAULT_SNIPPETS["lighter_optimizer"]
        if fix == "expandable_segments":
            return f"{EXPANDABLE_ENV} accelerate launch train.py ..."
        return DEFAULT_SNIPPETS.get(fix, "")

    def prescription_snippet(self, fixes: list[str], context: FrameworkContext) -> str:
        fixes = [part for fix in fixes for part in fix.split("+")]
        blocks = [self._accelerator(fixes, context)]
        if "lighter_optimizer" in fixes:
            blocks.append(
                lighter_optimizer_snippet({"optimizer": "Adafactor", **context})
                or DEFAULT_SNIPPETS["lighter_optimizer"]
            )
        if "checkpointing" in fixes:
            blocks.append(
                "# in the model's forward:\n"
                + (checkpointing_snippet(context) or DEFAULT_SNIPPETS["checkpointing"])
            )
        if "smaller_batch" in fixes:
            blocks.append(_accumulation_loop(context, "empty_cache" in fixes))
        elif "empty_cache" in fixes:
            blocks.append(DEFAULT_SNIPPETS["empty_cache"])
        if "expandable_segments" in fixes:
            blocks.append(f"# run with {EXPANDABLE_ENV}")
        own_flags = self.own_flags_block(fixes, context, "or with your script's own flags")
        if own_flags:
            blocks.append(own_flags)
        return "\n\n".join(blocks)
