"""The flags scripts commonly give a batch size: one list, read by the batch
search (oomdoc.replay.orchestrate), the framework units (oomdoc.frameworks)
and the CLI's help. Imports nothing: the CLI reads it at startup."""

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


def listed(flags: tuple[str, ...] = BATCH_FLAGS) -> str:
    """`--a, --b or -c`: the flags as a phrase."""
    return ", ".join(flags[:-1]) + f" or {flags[-1]}" if len(flags) > 1 else "".join(flags)
