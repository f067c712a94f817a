"""Where the script's command line gives its batch size: the flag the batch
search rewrites in each replay, found once here for the search, the
decisions and the evaluation batch's search alike."""

from __future__ import annotations

from oomdoc.model import Snapshot
from oomdoc.script_flags import (
    EVAL_BATCH_FLAGS,
    LONG_BATCH_FLAGS,
    batch_flags,
    is_short,
    nested_batch_flag,
)


def find_batch_arg(
    args: list[str], flag: str | None = None, flags: tuple[str, ...] = LONG_BATCH_FLAGS
) -> tuple[int, str, int] | None:
    """(index of the value, flag, batch size) of the last batch-size flag on
    the command line (`flag`, else one of `flags`), as `--batch-size 64`,
    `--batch-size=64`, or for a short flag also `-b64`."""
    names = (flag,) if flag else flags
    found = None
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args) and args[index + 1].isdigit():
                found = (index + 1, name, int(args[index + 1]))
            elif arg.startswith(name + "=") and arg[len(name) + 1 :].isdigit():
                found = (index, name, int(arg[len(name) + 1 :]))
            elif is_short(name) and arg.startswith(name) and arg[len(name) :].isdigit():
                found = (index, name, int(arg[len(name) :]))
    return found


def with_batch_size(args: list[str], position: int, flag: str, batch_size: int) -> list[str]:
    """args with the batch at `position` (find_batch_arg's) set, in its form."""
    rewritten = list(args)
    current = rewritten[position]
    if current.startswith(flag + "="):
        rewritten[position] = f"{flag}={batch_size}"
    elif is_short(flag) and current.startswith(flag):
        rewritten[position] = f"{flag}{batch_size}"
    else:
        rewritten[position] = str(batch_size)
    return rewritten


def find_search_batch(
    args: list[str], batch_arg: str | None, snapshot: Snapshot
) -> tuple[int, str, int] | None:
    """The batch the search changes (find_batch_arg's triple): the flag
    named with --batch-arg; at an OOM in evaluation, the script's
    evaluation batch flag when it is on the command line (its training
    batch does not decide that memory); else its training batch flag."""
    oom = snapshot.oom
    if batch_arg is None and oom is not None and oom.in_evaluation:
        found = find_batch_arg(args, None, EVAL_BATCH_FLAGS)
        if found is not None:
            return found
    if batch_arg is not None:
        return find_batch_arg(args, batch_arg)
    return find_training_batch_arg(args, script_batch_flags(snapshot))


def find_training_batch_arg(
    args: list[str], flags: tuple[str, ...] = LONG_BATCH_FLAGS
) -> tuple[int, str, int] | None:
    """The training batch on the command line: one of `flags`, else a
    nested configuration's batch flag (find_nested_batch_arg)."""
    return find_batch_arg(args, None, flags) or find_nested_batch_arg(args)


def find_nested_batch_arg(args: list[str]) -> tuple[int, str, int] | None:
    """find_batch_arg's triple for the last nested batch flag on the command
    line (script_flags.nested_batch_flag: `--trainer.batch_size=64`, or a
    Hydra override `data.batch_size=64`, which has only that form)."""
    found = None
    for index, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if not nested_batch_flag(name) or (not name.startswith("-") and "=" not in arg):
            continue
        attached = find_batch_arg(args[index : index + 2], name)
        if attached is not None:
            position, flag, value = attached
            found = (index + position, flag, value)
    return found


def script_batch_flags(snapshot: Snapshot) -> tuple[str, ...]:
    """The batch flags looked for on the script's command line."""
    return batch_flags(snapshot.script_options, snapshot.script_option_aliases)
