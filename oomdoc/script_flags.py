"""The flags scripts commonly give a batch size: one list, read by the batch
search (oomdoc.replay.search), the framework units (oomdoc.frameworks)
and the CLI's help; and how a script takes its options (the snapshot's
`script_option_syntax`), for every replay and snippet to write them so.
Imports nothing: the CLI reads it at startup."""

from __future__ import annotations

# Most specific first: where a script declares several, the first is its
# batch on one device. A short flag counts only as the script declares it,
# as one spelling of a long batch flag (`-b`/`--batch-size`).
BATCH_FLAGS = (
    "--per_device_train_batch_size",
    "--per-device-train-batch-size",
    "--train_batch_size",
    "--train-batch-size",
    "--batch-size",
    "--batch_size",
    "--bs",
    "--micro-batch-size",
    "--micro_batch_size",
    "--data.batch_size",
    "-b",
)
LONG_BATCH_FLAGS = tuple(flag for flag in BATCH_FLAGS if flag.startswith("--"))
# Evaluation batch sizes, as scripts and frameworks spell them: at an OOM in
# evaluation the batch search changes this one when it is on the command line.
EVAL_BATCH_FLAGS = (
    "--per_device_eval_batch_size",
    "--per-device-eval-batch-size",
    "--eval_batch_size",
    "--eval-batch-size",
    "--val_batch_size",
    "--val-batch-size",
    "--test_batch_size",
    "--test-batch-size",
)

# The snapshot's `script_option_syntax`: argparse takes `--key value`,
# `--key=value` and short flags; a configurator (nanoGPT's configurator.py,
# exec'd over the script's module globals) only `--key=value`.
ARGPARSE = "argparse"
CONFIGURATOR = "configurator"


# Sections of a nested configuration whose batch is not the training batch.
NOT_TRAINING_SECTIONS = frozenset(
    {"eval", "evaluation", "val", "valid", "validation", "test", "predict", "inference"}
)
BATCH_KEYS = ("batch_size", "train_batch_size", "micro_batch_size")


def nested_batch_flag(option: str) -> bool:
    """`--trainer.batch_size`: a long flag of a nested configuration (minGPT's
    CfgNode `--trainer.batch_size=64`, jsonargparse and LightningCLI
    `--data.batch_size`), or the key of a Hydra override (`data.batch_size`
    of `data.batch_size=64`, `+`-prefixed too), whose last key is a batch
    size, outside an evaluation's section. Scripts name their sections
    freely, so BATCH_FLAGS cannot list them; such a flag counts as it is on
    the command line."""
    if option.startswith("--") and "." in option:
        keys = option[2:]
    elif is_override_key(option):
        keys = option.lstrip("+")
    else:
        return False
    *sections, key = keys.replace("-", "_").split(".")
    return (
        key in BATCH_KEYS
        and all(sections)
        and not any(section.lower() in NOT_TRAINING_SECTIONS for section in sections)
    )


def is_override_key(option: str) -> bool:
    """`data.batch_size`, `+trainer.accumulate_grad_batches`: the key of a
    `key=value` override (Hydra's, OmegaConf's `from_cli`), which has no
    dashes and is written only as `key=value`."""
    keys = option[2:] if option.startswith("++") else option.removeprefix("+")
    return (
        all(part[:1].isalpha() or part[:1] == "_" for part in keys.split("."))
        and keys.replace(".", "").replace("_", "").replace("-", "").isalnum()
    )


# The batch search's `source` where it changes the script's DataLoaders.
DATALOADER_SOURCE = "DataLoader"


def from_command_line(source: str) -> bool:
    """Whether the batch search's `source` is an option on the script's
    command line (a flag, or an override key: a nested batch key found on
    it, or any named with --batch-arg), not its DataLoaders."""
    return source != DATALOADER_SOURCE and (source.startswith("-") or is_override_key(source))


def listed(flags: tuple[str, ...] = BATCH_FLAGS) -> str:
    """`--a, --b or -c`: the flags as a phrase."""
    return ", ".join(flags[:-1]) + f" or {flags[-1]}" if len(flags) > 1 else "".join(flags)


def batch_flags(script_options=(), aliases=None) -> tuple[str, ...]:
    """A script's batch flags, most specific first: the long ones of
    BATCH_FLAGS, then the short ones it declares for its batch size: `-b` of
    `-b/--batch-size` or a `-b` of its own (not the `-b` of `-b/--bits`),
    and any other short spelling of a long batch flag (`aliases`: the
    snapshot's `script_option_aliases`)."""
    aliases = aliases or {}
    declared = set(script_options or ())
    short = [
        flag
        for flag in BATCH_FLAGS
        if not flag.startswith("--") and flag in declared and aliases.get(flag, flag) in BATCH_FLAGS
    ]
    short += [
        spelling
        for spelling, option in aliases.items()
        if option in LONG_BATCH_FLAGS and is_short(spelling) and spelling not in short
    ]
    return LONG_BATCH_FLAGS + tuple(short)


def is_short(option: str) -> bool:
    """`-b`: one dash and one character, which argparse also takes with its
    value attached (`-b64`)."""
    return len(option) == 2 and option[0] == "-" and option[1] != "-"


def equals_only(syntax: str | None) -> bool:
    """Whether the script takes an option's value only as `--key=value`."""
    return syntax == CONFIGURATOR


def spelled(option: str, value: object, syntax: str | None = None) -> str:
    """`--batch_size=4` for a configurator script or a nested key
    (`--trainer.batch_size=4`: minGPT's CfgNode takes only that form),
    `data.batch_size=4` for an override, else `--batch-size 4`."""
    if (
        equals_only(syntax)
        or (option.startswith("--") and "." in option)
        or not option.startswith("-")
    ):
        return f"{option}={value}"
    return f"{option} {value}"
