"""The script's command line as the by-hand benchmarks rewrite it, and a
prescription as their tables name it (imported
by its siblings: `python benchmarks/<name>.py` puts this folder on the path)."""

from __future__ import annotations


def set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag` set to `value`: in place where it is given
    (`--flag value` or `--flag=value`), else added at the end."""
    args = list(args)
    for position, item in enumerate(args):
        if item == flag:
            args[position + 1] = value
            return args
        if item.startswith(flag + "="):
            args[position] = f"{flag}={value}"
            return args
    return [*args, flag, value]


def script_after_dashes(values: list[str]) -> list[str]:
    """The script and its arguments from an argparse REMAINDER, without the
    `--` that separates them from the benchmark's own options."""
    return values[1:] if values[:1] == ["--"] else values


def prescription_label(prescription: dict | None) -> str:
    """A snapshot's prescription as the benchmarks' tables name it: "autocast +
    checkpointing at 32 x 8" ("no fix" without savers, "none" without one)."""
    if not prescription:
        return "none"
    fixes = " + ".join(prescription.get("fixes") or []) or "no fix"
    steps = prescription.get("accumulation_steps") or 1
    return f"{fixes} at {prescription.get('batch_size')} x {steps}"
