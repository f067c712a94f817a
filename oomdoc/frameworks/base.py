"""What every framework unit offers, and the command-line helpers they share.

A unit speaks one framework's language: how each fix is written there
(`snippet`), how several fixes become one configuration (`prescription_snippet`),
and the script's own command-line flag for a fix (`flag_variant`), so that a
replay can verify the user's knob next to oomdoc's own applied fix.

The `context` every method takes is a FrameworkContext: a fix's
SnippetContext (what the replays learned) and the snapshot's part.

Torch-free: the parent imports this.
"""

from __future__ import annotations

import shlex
from typing import Optional

from oomdoc.fixes.base import SnippetContext
from oomdoc.script_flags import batch_flags, equals_only, from_command_line, is_short


class FrameworkContext(SnippetContext, total=False):
    """A fix's SnippetContext and what the snapshot holds for every unit
    (oomdoc.frameworks.context_from_snapshot)."""

    # The snapshot's `framework.entry` (`Trainer`, `Fabric`, ...), import
    # name (`framework.module`) and version
    entry: Optional[str]
    module: Optional[str]
    version: Optional[str]
    # The snapshot's `command`: `[SCRIPT, *ARGS]` or `["-m", MODULE, *ARGS]`
    command: list[str]
    # The snapshot's keys of the same names
    script_options: list[str]
    script_option_values: dict[str, list[str]]
    script_option_aliases: dict[str, str]
    script_option_defaults: dict[str, str]


EXPANDABLE_ENV = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def split_command(command: list[str]) -> tuple[list[str], list[str]]:
    """A snapshot's `command` as (how to run it: `python SCRIPT` or `python
    -m MODULE`, the script's own arguments)."""
    if command[:1] == ["-m"]:
        return ["python", "-m", *command[1:2]], list(command[2:])
    return ["python", *command[:1]], list(command[1:])


def command_with_option(
    command: list[str], option: str, value: str, syntax: str | None = None
) -> list[str]:
    """The snapshot's `command` with the script's `option` set to `value`."""
    head = 2 if command[:1] == ["-m"] else 1
    return [*command[:head], *with_option(command[head:], option, value, syntax)]


# Command-line flags scripts commonly declare for each fix, most specific
# first. A flag is used only when the script declares it (`script_options`).
ACCUMULATION_FLAGS = (
    "--gradient_accumulation_steps",
    "--gradient-accumulation-steps",
    "--grad-accum",
    "--grad_accum",
    "--grad-accum-steps",
    "--grad_accum_steps",
    "--accumulation-steps",
    "--accumulation_steps",
    "--accum-steps",
    "--accum_steps",
    "--accumulate-grad-batches",
    "--accumulate_grad_batches",
    "--trainer.accumulate_grad_batches",
)
CHECKPOINTING_FLAGS = (
    "--gradient_checkpointing",
    "--gradient-checkpointing",
    "--checkpointing",
    "--activation-checkpointing",
    "--activation_checkpointing",
    "--grad-checkpointing",
    "--grad_checkpointing",
    "--checkpoint-activations",
    "--checkpoint_activations",
)
# (flag, the dtype it is limited to, or None for a flag that takes the dtype as its value)
AUTOCAST_FLAGS = (
    ("--autocast", None),
    ("--amp", None),
    ("--mixed-precision", None),
    ("--mixed_precision", None),
    ("--precision", None),
    ("--trainer.precision", None),
    ("--bf16", "bfloat16"),
    ("--fp16", "float16"),
)
# Values that mean the dtype, preferred first, for a flag that takes one.
DTYPE_VALUES = {
    "bfloat16": ("bf16", "bfloat16", "bf16-mixed"),
    "float16": ("fp16", "float16", "16-mixed", "16"),
}
# Flags that bound how many steps a script runs (optimizer steps or
# micro-batches, depending on the script).
STEPS_FLAGS = (
    "--max_steps",
    "--max-steps",
    "--steps",
    "--num_steps",
    "--num-steps",
    "--train_steps",
    "--train-steps",
    "--max_iters",
    "--max-iters",
    "--iters",
)
OPTIMIZER_FLAGS = ("--optim", "--optimizer", "--opt")
EMPTY_CACHE_FLAGS = ("--empty-cache", "--empty_cache")


class Framework:
    """One framework's words for the fixes. Subclasses set `name` (the
    snapshot's `framework.name`) and `label`, and override what differs."""

    name = "plain"
    label = "a plain PyTorch loop"
    # Values a flag that takes the dtype gets when it lists no choices.
    dtype_values = {"bfloat16": "bf16", "float16": "fp16"}
    # Modules a replay's warm child imports ahead besides the snapshot's
    # `imported_packages`: what the framework loads lazily (oomdoc.capture.imports).
    preimports: tuple[str, ...] = ()

    def snippet(self, fix: str, context: FrameworkContext) -> str:
        """How to apply `fix` (or `a+b`) by hand, in this framework's knobs."""
        raise NotImplementedError

    def prescription_snippet(self, fixes: list[str], context: FrameworkContext) -> str:
        """Several fixes as one configuration block in this framework's terms."""
        raise NotImplementedError

    def evaluation_batch_snippet(self, batch: int, context: FrameworkContext) -> str:
        """How to run the evaluation at `batch`, the training batch untouched:
        an OOM in evaluation is searched through the evaluation's own batch
        (context `how`: the script's option, else its evaluation loader),
        and writing it as the training batch would change what fits."""
        own = self.evaluation_option_block(batch, context)
        if own:
            return own
        return (
            f"val_loader = DataLoader(val_set, batch_size={batch})  "
            "# the evaluation's loader; the training batch stays as it is"
        )

    def evaluation_option_block(self, batch: int, context: FrameworkContext) -> str:
        """`# your script's own evaluation batch size:` and the command with
        the option set; empty when the search did not go through an option."""
        how = context.get("how") or ""
        command = context.get("command")
        if not from_command_line(how):
            return ""
        if not command:
            return f"# your script's own evaluation batch size:\npython train.py ... {how} {batch}"
        head, args = split_command(
            command_with_option(command, how, str(batch), context.get("script_option_syntax"))
        )
        return f"# your script's own evaluation batch size:\n{shlex.join([*head, *args])}"

    def flag_variant(
        self, fix: str, args: list[str], script_options: list[str], context: FrameworkContext
    ) -> list[str] | None:
        """The script's argv with its own flag for `fix` added (or set), when
        the script declares one, else None (also None when it is already on).
        `a+b` applies both parts, or is None when either has no flag."""
        parts = fix.split("+")
        if len(parts) > 1:
            variant: list[str] | None = list(args)
            for part in parts:
                variant = self.flag_variant(part, variant or [], script_options, context)
                if variant is None:
                    return None
            return variant
        return generic_flag_variant(fix, args, script_options, context, self.dtype_values)

    # ------------------------------------------------------------ shared
    def command_with_flags(self, fixes: list[str], context: FrameworkContext) -> str | None:
        """The script's command with its own flags for every fix that has one
        (None when none has): the by-hand run of a prescription."""
        command = context.get("command")
        options = context.get("script_options")
        if not command or not options:
            return None
        head, args = split_command(command)
        changed = False
        for fix in fixes:
            variant = self.flag_variant(fix, args, options, context)
            if variant is not None:
                args, changed = variant, True
        if not changed:
            return None
        env = f"{EXPANDABLE_ENV} " if "expandable_segments" in fixes else ""
        return env + shlex.join([*head, *args])

    def own_flags_block(
        self, fixes: list[str], context: FrameworkContext, label: str
    ) -> str | None:
        """`# label:` and the command with the script's own flags; when some
        fixes have no flag there, the label says which ones it covers."""
        command = self.command_with_flags(fixes, context)
        if command is None:
            return None
        _head, args = split_command(context["command"])
        options = context.get("script_options") or []
        flagged: list[str] = []
        missing: list[str] = []
        for fix in fixes:
            if fix == "expandable_segments":
                continue
            has_flag = self.flag_variant(fix, args, options, context) is not None
            (flagged if has_flag else missing).append(fix)
        if missing:
            label = f"your script's own flags cover {', '.join(flagged)} (not {', '.join(missing)})"
        return f"# {label}:\n{command}"


def effective_batch_comment(context: FrameworkContext) -> str:
    """`2 accumulation steps of 12 keep the effective batch at 24`, or empty."""
    micro, steps = context.get("micro_batch"), context.get("accumulation_steps")
    if not micro or not steps:
        return ""
    return f"{steps} accumulation steps of {micro} keep the effective batch at {micro * steps}"


def declared(script_options, *names: str) -> str | None:
    """The first of `names` that the script declares."""
    options = set(script_options or ())
    for name in names:
        if name in options:
            return name
    return None


def takes_value(option: str, context: FrameworkContext) -> bool:
    """Whether the option needs a value (unknown: as a switch)."""
    return option in (context.get("script_option_values") or {})


def choices_of(option: str, context: FrameworkContext) -> list[str]:
    return list((context.get("script_option_values") or {}).get(option) or [])


def find_option(args: list[str], option: str) -> tuple[int, str | None] | None:
    """(index, value or None) of the last `option` in args, as `--x v`,
    `--x=v`, a bare `--x` (value None), or for a short option `-x5`."""
    found = None
    for index, arg in enumerate(args):
        if arg == option:
            value = args[index + 1] if index + 1 < len(args) else None
            found = (index, None if value is None or value.startswith("--") else value)
        elif arg.startswith(option + "="):
            found = (index, arg[len(option) + 1 :])
        elif is_short(option) and arg.startswith(option) and not arg.startswith("--"):
            found = (index, arg[len(option) :])
    return found


def with_option(
    args: list[str], option: str, value: str | None = None, syntax: str | None = None
) -> list[str]:
    """args with `option` set to `value` (a bare switch when None): an
    occurrence already there is rewritten in its form, else the option is
    appended, as `--key=value` where the script takes only that (`syntax`,
    the snapshot's `script_option_syntax`)."""
    rewritten = list(args)
    found = find_option(rewritten, option)
    if found is None:
        if value is not None and (equals_only(syntax) or not option.startswith("-")):
            return [*rewritten, f"{option}={value}"]  # (an override: `key=value` only)
        return [*rewritten, option] + ([] if value is None else [value])
    index, old = found
    if rewritten[index].startswith(option + "="):
        rewritten[index] = option if value is None else f"{option}={value}"
    elif rewritten[index] != option:  # a short option's attached value: -b64
        rewritten[index] = option + (value or "")
    elif old is not None:
        if value is None:
            del rewritten[index + 1]
        else:
            rewritten[index + 1] = value
    elif value is not None:
        rewritten.insert(index + 1, value)
    return rewritten


_TRUE = {"true", "1", "yes", "y", "on"}


def switch_is_on(args: list[str], option: str) -> bool:
    found = find_option(args, option)
    if found is None:
        return False
    return found[1] is None or found[1].lower() in _TRUE


def dtype_value(option: str, dtype: str, context: FrameworkContext, defaults: dict) -> str | None:
    """The value for a flag that takes the dtype: one of its choices when it
    lists them (None when none means the dtype), else the framework's default."""
    choices = choices_of(option, context)
    if not choices:
        return defaults.get(dtype)
    lowered = {choice.lower(): choice for choice in choices}
    for candidate in DTYPE_VALUES.get(dtype, ()):
        if candidate in lowered:
            return lowered[candidate]
    return None


def accumulation_in_effect(args: list[str], script_options, defaults=None) -> int:
    """The gradient accumulation the script's flag asks for: its value on
    the command line, else the script's default for it (`defaults`: the
    snapshot's script_option_defaults), else 1. A new value is this times
    the steps wanted: a script may divide it (nanoGPT divides it by the
    world size), and the product keeps that division right."""
    flag = declared(script_options, *ACCUMULATION_FLAGS)
    found = find_option(args, flag) if flag else None
    value = found[1] if found else (defaults or {}).get(flag) if flag else None
    return int(value) if value and value.isdigit() and int(value) > 0 else 1


def with_enough_steps(
    args: list[str], script_options, context: FrameworkContext, needed: int
) -> tuple[list[str], str | None]:
    """args with the script's steps flag (`--max_steps`, `--steps`, ...)
    raised to `needed` when it is below that or not given (its default is
    unknown), and a sentence saying so; unchanged without such a flag."""
    syntax = context.get("script_option_syntax")
    for option in STEPS_FLAGS:
        if option not in (script_options or ()) or not takes_value(option, context):
            continue
        found = find_option(args, option)
        value = found[1] if found else None
        if value is not None and value.lstrip("-").isdigit() and int(value) >= needed:
            return args, None
        was = f"from {value}" if value is not None else "(not on the command line)"
        return with_option(args, option, str(needed), syntax), f"{option} raised to {needed} {was}"
    return args, None


def generic_flag_variant(
    fix: str, args: list[str], script_options, context: FrameworkContext, dtype_defaults: dict
) -> list[str] | None:
    """The flags a script commonly declares for a fix, written as the
    script takes them (context's `script_option_syntax`)."""
    syntax = context.get("script_option_syntax")
    if fix == "checkpointing":
        for option in CHECKPOINTING_FLAGS:
            if option in (script_options or ()) and not takes_value(option, context):
                return None if switch_is_on(args, option) else with_option(args, option)
        return None
    if fix == "autocast":
        dtype = context.get("dtype", "bfloat16")
        for option, limited_to in AUTOCAST_FLAGS:
            if option not in (script_options or ()):
                continue
            if limited_to is not None:
                if limited_to != dtype or takes_value(option, context):
                    continue
                return None if switch_is_on(args, option) else with_option(args, option)
            if not takes_value(option, context):
                continue  # a switch without a dtype: which one it means is unknown
            value = dtype_value(option, dtype, context, dtype_defaults)
            if value is None:
                continue
            found = find_option(args, option)
            if found is not None and found[1] == value:
                return None
            return with_option(args, option, value, syntax)
        return None
    if fix == "smaller_batch":
        micro, steps = context.get("micro_batch"), context.get("accumulation_steps")
        how = context.get("how") or ""
        batch_flag = (
            how
            if from_command_line(how)
            else declared(
                script_options,
                *batch_flags(script_options, context.get("script_option_aliases")),
            )
        )
        accumulation_flag = declared(script_options, *ACCUMULATION_FLAGS)
        if not micro or not steps or not batch_flag or not accumulation_flag:
            return None
        if batch_flag not in (script_options or ()) and find_option(args, batch_flag) is None:
            return None
        already = accumulation_in_effect(
            args, script_options, context.get("script_option_defaults")
        )
        variant = with_option(args, batch_flag, str(micro), syntax)
        return with_option(variant, accumulation_flag, str(already * steps), syntax)
    if fix == "lighter_optimizer":
        wanted = str(context.get("optimizer") or "Adafactor").lower()
        for option in OPTIMIZER_FLAGS:
            if option not in (script_options or ()) or not takes_value(option, context):
                continue
            lowered = {choice.lower(): choice for choice in choices_of(option, context)}
            value = lowered.get(wanted)
            if value is None:
                continue
            found = find_option(args, option)
            return None if found and found[1] == value else with_option(args, option, value, syntax)
        return None
    if fix == "empty_cache":
        switch = declared(script_options, *EMPTY_CACHE_FLAGS)
        if switch is None or takes_value(switch, context) or switch_is_on(args, switch):
            return None
        return with_option(args, switch)
    return None
