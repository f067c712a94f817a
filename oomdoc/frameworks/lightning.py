"""Lightning: the `Trainer`'s arguments (precision, accumulate_grad_batches),
checkpointing and the optimizer inside the LightningModule, the batch size in
the DataModule; or, for Fabric, `Fabric(precision=...)` and its loop."""

from __future__ import annotations

from oomdoc.fixes import checkpointing
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
from oomdoc.script_flags import from_command_line, spelled

PRECISION = {"bfloat16": "bf16-mixed", "float16": "16-mixed"}


def _alias(context: FrameworkContext) -> str:
    """`pl` for `import pytorch_lightning as pl`, else `L` (`import lightning as L`)."""
    return "pl" if context.get("module") == "pytorch_lightning" else "L"


def _import_line(context: FrameworkContext) -> str:
    if context.get("module") == "pytorch_lightning":
        return "import pytorch_lightning as pl"
    return "import lightning as L"


def _precision(context: FrameworkContext) -> str:
    return PRECISION.get(context.get("dtype", "bfloat16"), "bf16-mixed")


def _module_checkpointing(context: FrameworkContext) -> str:
    """Checkpointing written inside the LightningModule's forward."""
    body = "".join(f"        {line}\n" for line in checkpointing.loops(context, "self"))
    return (
        "from torch.utils.checkpoint import checkpoint\n\n"
        f"class LitModel({_alias(context)}.LightningModule):\n"
        "    def forward(self, x):\n"
        f"{body}"
        "        ...\n"
        "# a Hugging Face model inside the module: self.model.gradient_checkpointing_enable()"
    )


def _module_optimizer(context: FrameworkContext) -> str:
    return (
        "def configure_optimizers(self):  # in your LightningModule\n"
        "    return torch.optim.Adafactor(self.parameters(), lr=lr)  # factored second moments"
    )


def _module_empty_cache() -> str:
    return (
        "def on_train_batch_end(self, outputs, batch, batch_idx):  # in your LightningModule\n"
        "    torch.cuda.empty_cache()"
    )


class Lightning(Framework):
    name = "lightning"
    label = "Lightning"
    dtype_values = PRECISION

    def _fabric(self, context: FrameworkContext) -> bool:
        return context.get("entry") == "Fabric"

    def _trainer_arguments(self, fixes: list[str], context: FrameworkContext) -> list[str]:
        arguments = []
        if "autocast" in fixes:
            tail = (
                "  # no bf16 on this GPU: Lightning scales the loss"
                if context.get("dtype") == "float16"
                else ""
            )
            arguments.append(f'precision="{_precision(context)}",{tail}')
        if "smaller_batch" in fixes:
            steps = context.get("accumulation_steps") or 2
            comment = effective_batch_comment(context) or "keeps the effective batch"
            arguments.append(f"accumulate_grad_batches={steps},  # {comment}")
        return arguments

    def _batch_line(self, context: FrameworkContext) -> str:
        micro = context.get("micro_batch")
        size = str(micro) if micro else "BATCH // 2"
        line = f"# batch_size={size} in your DataModule (its train_dataloader's DataLoader)"
        how = context.get("how") or ""
        if from_command_line(how) and micro:
            syntax = context.get("script_option_syntax")
            line += f"\n# or on the command line: {spelled(how, micro, syntax)}"
        return line

    def evaluation_batch_snippet(self, batch: int, context: FrameworkContext) -> str:
        """The validation loader's batch; the training loader's stays."""
        text = (
            "def val_dataloader(self):  # in your LightningModule or DataModule\n"
            f"    return DataLoader(val_set, batch_size={batch})  # the training batch stays"
        )
        own = self.evaluation_option_block(batch, context)
        return f"{text}\n{own}" if own else text

    def snippet(self, fix: str, context: FrameworkContext) -> str:
        parts = fix.split("+")
        if len(parts) > 1:
            return self.prescription_snippet(parts, context)
        if self._fabric(context):
            return self._fabric_snippet(fix, context)
        alias = _alias(context)
        if fix == "autocast":
            text = f'trainer = {alias}.Trainer(..., precision="{_precision(context)}")'
            if context.get("dtype") == "float16":
                text += "  # no bf16 on this GPU: Lightning scales the loss"
            return text
        if fix == "smaller_batch":
            steps = context.get("accumulation_steps") or 2
            comment = effective_batch_comment(context) or "keeps the effective batch"
            return (
                f"trainer = {alias}.Trainer(..., accumulate_grad_batches={steps})  # {comment}\n"
                + self._batch_line(context)
            )
        if fix == "checkpointing":
            return _module_checkpointing(context)
        if fix == "lighter_optimizer":
            return _module_optimizer(context)
        if fix == "empty_cache":
            return _module_empty_cache()
        if fix == "expandable_segments":
            return f"{EXPANDABLE_ENV} python train.py ..."
        return DEFAULT_SNIPPETS.get(fix, "")

    def _fabric_snippet(self, fix: str, context: FrameworkContext) -> str:
        alias = _alias(context)
        if fix == "autocast":
            return f'fabric = {alias}.Fabric(..., precision="{_precision(context)}")'
        if fix == "smaller_batch":
            return self._fabric_loop(context)
        if fix == "checkpointing":
            return checkpointing_snippet(context) or DEFAULT_SNIPPETS["checkpointing"]
        if fix == "lighter_optimizer":
            return lighter_optimizer_snippet(context) or DEFAULT_SNIPPETS["lighter_optimizer"]
        if fix == "expandable_segments":
            return f"{EXPANDABLE_ENV} python train.py ..."
        return DEFAULT_SNIPPETS.get(fix, "")

    def _fabric_loop(self, context: FrameworkContext) -> str:
        steps = context.get("accumulation_steps") or 2
        micro = context.get("micro_batch")
        comment = effective_batch_comment(context)
        return (
            f"accumulation_steps = {steps}"
            + (f"  # DataLoader batch_size={micro}: {comment}" if comment else "")
            + "\n"
            "for i, (x, y) in enumerate(loader):\n"
            "    accumulating = (i + 1) % accumulation_steps != 0\n"
            "    with fabric.no_backward_sync(model, enabled=accumulating):\n"
            "        loss = loss_fn(model(x), y) / accumulation_steps\n"
            "        fabric.backward(loss)\n"
            "    if not accumulating:\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad(set_to_none=True)"
        )

    def prescription_snippet(self, fixes: list[str], context: FrameworkContext) -> str:
        fixes = [part for fix in fixes for part in fix.split("+")]
        alias = _alias(context)
        blocks = []
        if self._fabric(context):
            precision = f', precision="{_precision(context)}"' if "autocast" in fixes else ""
            blocks.append(f"{_import_line(context)}\nfabric = {alias}.Fabric(...{precision})")
            if "smaller_batch" in fixes:
                blocks.append(self._fabric_loop(context))
            for fix in ("checkpointing", "lighter_optimizer", "empty_cache"):
                if fix in fixes:
                    blocks.append(self._fabric_snippet(fix, context))
        else:
            arguments = self._trainer_arguments(fixes, context)
            if arguments:  # none: the changes are all in the module
                lines = [f"trainer = {alias}.Trainer(", "    ...,  # your other arguments"]
                lines += [f"    {argument}" for argument in arguments]
                lines.append(")")
                blocks.append("\n".join(lines))
            if "smaller_batch" in fixes:
                blocks.append(self._batch_line(context))
            if "checkpointing" in fixes:
                blocks.append(_module_checkpointing(context))
            if "lighter_optimizer" in fixes:
                blocks.append(_module_optimizer(context))
            if "empty_cache" in fixes:
                blocks.append(_module_empty_cache())
        if "expandable_segments" in fixes:
            blocks.append(f"# run with {EXPANDABLE_ENV}")
        own_flags = self.own_flags_block(fixes, context, "or with your script's own flags")
        if own_flags:
            blocks.append(own_flags)
        return "\n\n".join(blocks)
