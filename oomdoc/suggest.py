"""`oomdoc suggest`: load any accepted snapshot, analyse it, print it."""

from __future__ import annotations

import sys
from typing import TextIO

from oomdoc.analysis import analyse
from oomdoc.loaders import load_snapshot
from oomdoc.reporters import render
from oomdoc.snapshot import write_atomic


def run_suggest(
    path: str,
    output_format: str,
    top: int,
    stdout: TextIO | None = None,
    output: str | None = None,
) -> int:
    """Print (or, with `output`, write) the report of the snapshot at `path`."""
    stdout = stdout or sys.stdout
    loaded = load_snapshot(path)
    analysis = analyse(loaded.snapshot, top=top, source_format=loaded.source_format, path=path)
    text = render(output_format, analysis)
    if output_format == "table":
        text = text.lstrip("\n")
    if output:
        write_atomic(output, text)
        print(f"oomdoc: wrote {output}", file=sys.stderr)
    else:
        stdout.write(text)
    return 0
