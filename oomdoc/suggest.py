"""`oomdoc suggest`: load any accepted snapshot, analyse it, print it."""

from __future__ import annotations

import sys
from typing import TextIO

from oomdoc.analysis import analyse
from oomdoc.loaders import load_snapshot
from oomdoc.reporters import render


def run_suggest(path: str, output_format: str, top: int, stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    loaded = load_snapshot(path)
    analysis = analyse(loaded.snapshot, top=top, source_format=loaded.source_format, path=path)
    text = render(output_format, analysis)
    stdout.write(text.lstrip("\n") if output_format == "table" else text)
    return 0
