"""Files oomdoc writes for the user: checked before anything runs, and
written under a free name when theirs was taken meanwhile.

A path that cannot be written is a usage error found in a second (one line,
exit status 2), not a traceback after the whole run, which CI would read as a
memory regression. Nothing the user had is overwritten, and nothing oomdoc
measured is lost because a name was taken while the script ran.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from oomdoc.errors import UsageError

# Longest file name most file systems take (bytes).
MAX_NAME_BYTES = 255


def _nearest_existing(directory: str) -> str:
    while not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return directory


def _probe_writable(directory: str) -> bool:
    """Whether a file can be created in `directory` (tried: os.access says
    yes to root on a file system that refuses it, e.g. /proc)."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".oomdoc-probe-", dir=directory)
    except OSError:
        return False
    os.close(descriptor)
    os.unlink(probe)
    return True


def check_output_file(
    path: str | os.PathLike | None,
    flag: str,
    *,
    replace: bool = False,
    create_parents: bool = False,
) -> str | None:
    """`path`, when oomdoc can write it; else UsageError. Without `replace`
    an existing file (a dangling symbolic link too) is refused; with it, only
    a regular file is replaced. `create_parents`: missing directories are
    made when the file is written (the snapshot's default .oomdoc/)."""
    if path is None:
        return None
    text = os.fspath(path)
    if not text.strip():
        raise UsageError(f"{flag}: the path is empty")
    if "\0" in text:
        raise UsageError(f"{flag} {text!r}: a path may not contain a NUL character")
    if text.endswith(os.sep) or os.path.isdir(text):
        raise UsageError(f"{flag} {text}: is a directory")
    if len(os.fsencode(os.path.basename(text))) > MAX_NAME_BYTES:
        raise UsageError(f"{flag} {text}: file name too long")
    if os.path.lexists(text):
        if not replace:
            what = "a symbolic link" if os.path.islink(text) else "a file"
            raise UsageError(
                f"{flag} {text}: already exists ({what}; oomdoc never overwrites a file)"
            )
        if not os.path.isfile(text) or os.path.islink(text):
            raise UsageError(f"{flag} {text}: is not a regular file (oomdoc replaces only a file)")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        existing = _nearest_existing(parent)
        if not create_parents or not os.path.isdir(existing):
            what = "is not a directory" if os.path.lexists(existing) else "does not exist"
            raise UsageError(f"{flag} {text}: no such directory {parent} ({existing} {what})")
        parent = existing
    if not _probe_writable(parent):
        raise UsageError(f"{flag} {text}: cannot write in {parent} (permission denied)")
    return text


def free_name(path: Path, attempt: int) -> Path:
    """`run.json`, then `run-1.json`, `run-2.json`, ..."""
    return path if attempt == 0 else path.with_name(f"{path.stem}-{attempt}{path.suffix}")


def write_new_file(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path`, or, when a file took that name meanwhile (a
    run started in the same second, a file or link made during the run),
    to the first free `<stem>-N<suffix>` beside it. Returns where it went."""
    from oomdoc.snapshot import write_atomic

    wanted = Path(path)
    for attempt in range(10_000):
        try:
            return write_atomic(free_name(wanted, attempt), text)
        except FileExistsError:
            continue
    raise FileExistsError(f"{wanted}: no free name beside it")
