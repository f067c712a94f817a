"""The Hugging Face `Trainer`: fixes as `TrainingArguments` fields and the
HfArgumentParser flags of the same names."""

from __future__ import annotations

from oomdoc.frameworks.base import (
    EXPANDABLE_ENV,
    Framework,
    FrameworkContext,
    accumulation_in_effect,
    declared,
    effective_batch_comment,
    find_option,
    generic_flag_variant,
    switch_is_on,
    with_option,
)
from oomdoc.frameworks.plain import DEFAULT_SNIPPETS
from oomdoc.script_flags import from_command_line

BATCH_FIELD = "per_device_train_batch_size"


def _flag(field: str) -> str:
    return f"--{field}"


def checkpointing_field(context: FrameworkContext) -> str:
    """`activation_checkpointing` where the script's TrainingArguments have it
    (newer transformers, where `gradient_checkpointing` is its deprecated
    alias), else `gradient_checkpointing`."""
    if "--activation_checkpointing" in (context.get("script_options") or ()):
        return "activation_checkpointing"
    return "gradient_checkpointing"


class HuggingFace(Framework):
    name = "transformers"
    label = "the Hugging Face Trainer"
    # `import transformers` is lazy: the Trainer's module is the seconds.
    preimports = ("transformers.trainer",)

    def fields(self, fix: str, context: FrameworkContext) -> list[tuple[str, str, str]]:
        """(TrainingArguments field, its value as Python, as a flag value ('' for
        a switch)) that apply `fix`; empty when the Trainer has no knob for it."""
        if fix == "smaller_batch":
            micro, steps = context.get("micro_batch"), context.get("accumulation_steps")
            if not micro or not steps:
                return []
            return [
                (BATCH_FIELD, str(micro), str(micro)),
                ("gradient_accumulation_steps", str(steps), str(steps)),
            ]
        if fix == "autocast":
            field = "fp16" if context.get("dtype") == "float16" else "bf16"
            return [(field, "True", "")]
        if fix == "checkpointing":
            return [(checkpointing_field(context), "True", "")]
        if fix == "lighter_optimizer":
            return [("optim", '"adafactor"', "adafactor")]
        if fix == "empty_cache":
            return [("torch_empty_cache_steps", "1", "1")]
        return []

    def _comment(self, fix: str, context: FrameworkContext) -> str:
        if fix == "smaller_batch":
            return effective_batch_comment(context)
        if fix == "autocast" and context.get("dtype") == "float16":
            return "no bf16 on this GPU: fp16 with loss scaling (the Trainer scales the loss)"
        if fix == "checkpointing":
            blocks = context.get("blocks_path")
            what = (
                f"{context.get('blocks_count', '?')} x {context.get('blocks_class', 'block')} in {blocks}"
                if blocks
                else "the model's layers"
            )
            return f"recomputes {what} in backward"
        if fix == "lighter_optimizer":
            return 'factored second moments (or optim="adamw_torch_8bit")'
        if fix == "empty_cache":
            return "torch.cuda.empty_cache() every step"
        return ""

    def _flags_text(self, fields, context: FrameworkContext) -> str:
        return " ".join(
            _flag(field) + (f" {flag_value}" if flag_value else "")
            for field, _value, flag_value in fields
        )

    def snippet(self, fix: str, context: FrameworkContext) -> str:
        parts = fix.split("+")
        if len(parts) > 1:
            return self.prescription_snippet(parts, context)
        if fix == "expandable_segments":
            return f"{EXPANDABLE_ENV} python train.py ..."
        fields = self.fields(fix, context)
        if not fields:
            if fix == "smaller_batch":
                return (
                    "training_args = TrainingArguments(\n"
                    "    ...,\n"
                    f"    {BATCH_FIELD}=BATCH // 2,\n"
                    "    gradient_accumulation_steps=2,  # keeps the effective batch\n"
                    ")\n"
                    "# or on the command line: --per_device_train_batch_size BATCH/2 --gradient_accumulation_steps 2"
                )
            return DEFAULT_SNIPPETS.get(fix, "")
        comment = self._comment(fix, context)
        lines = ["training_args = TrainingArguments(", "    ...,"]
        for index, (field, value, _flag_value) in enumerate(fields):
            tail = f"  # {comment}" if comment and index == len(fields) - 1 else ""
            lines.append(f"    {field}={value},{tail}")
        lines.append(")")
        lines.append(f"# or on the command line: {self._flags_text(fields, context)}")
        if fix == "checkpointing":
            method = f"{checkpointing_field(context)}_enable"
            lines.append(f"# or, without the Trainer's switch: model.{method}()")
        return "\n".join(lines)

    def evaluation_batch_snippet(self, batch: int, context: FrameworkContext) -> str:
        """The Trainer's evaluation batch; the training batch stays."""
        lines = [
            "training_args = TrainingArguments(",
            "    ...,",
            f"    per_device_eval_batch_size={batch},  # the evaluation batch; training's stays",
            ")",
        ]
        own = self.evaluation_option_block(batch, context)
        lines.append(own or f"# or on the command line: --per_device_eval_batch_size {batch}")
        return "\n".join(lines)

    def prescription_snippet(self, fixes: list[str], context: FrameworkContext) -> str:
        """One TrainingArguments(...) with every knob, then the same as flags."""
        fixes = [part for fix in fixes for part in fix.split("+")]
        lines = ["training_args = TrainingArguments(", "    ...,  # your other arguments"]
        all_fields = []
        for fix in fixes:
            fields = self.fields(fix, context)
            all_fields += fields
            comment = self._comment(fix, context)
            for index, (field, value, _flag_value) in enumerate(fields):
                tail = f"  # {comment}" if comment and index == len(fields) - 1 else ""
                lines.append(f"    {field}={value},{tail}")
        lines.append(")")
        blocks = ["\n".join(lines)]
        own_flags = self.own_flags_block(fixes, context, "the same on your script's command line")
        if own_flags:
            blocks.append(own_flags)
        elif all_fields:
            env = f"{EXPANDABLE_ENV} " if "expandable_segments" in fixes else ""
            blocks.append(
                "# the same with HfArgumentParser flags:\n"
                f"{env}python train.py ... {self._flags_text(all_fields, context)}"
            )
        elif "expandable_segments" in fixes:
            blocks.append(f"{EXPANDABLE_ENV} python train.py ...")
        if "smaller_batch" in fixes and not self.fields("smaller_batch", context):
            blocks.append(self.snippet("smaller_batch", context))
        return "\n\n".join(blocks)

    def flag_variant(
        self, fix: str, args: list[str], script_options: list[str], context: FrameworkContext
    ) -> list[str] | None:
        parts = fix.split("+")
        if len(parts) > 1:
            return super().flag_variant(fix, args, script_options, context)
        options = set(script_options or ())
        if fix == "smaller_batch":
            micro, steps = context.get("micro_batch"), context.get("accumulation_steps")
            how = context.get("how") or ""
            batch_flag = how if from_command_line(how) else declared(options, _flag(BATCH_FIELD))
            accumulation = declared(options, "--gradient_accumulation_steps")
            if micro and steps and batch_flag and accumulation:
                already = accumulation_in_effect(
                    args, [accumulation], context.get("script_option_defaults")
                )
                variant = with_option(args, batch_flag, str(micro))
                return with_option(variant, accumulation, str(already * steps))
            return generic_flag_variant(fix, args, script_options, context, self.dtype_values)
        for field, _value, flag_value in self.fields(
            fix, {**context, "script_options": script_options}
        ):
            option = _flag(field)
            if option not in options:
                break
            if not flag_value:
                return None if switch_is_on(args, option) else with_option(args, option)
            found = find_option(args, option)
            if found is not None and found[1] == flag_value:
                return None
            return with_option(args, option, flag_value)
        return generic_flag_variant(fix, args, script_options, context, self.dtype_values)
