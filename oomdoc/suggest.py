"""`oomdoc suggest`: load any accepted snapshot, diagnose it, print it."""

from __future__ import annotations

import json
import sys

from oomdoc import report
from oomdoc.diagnose import analysis
from oomdoc.loaders import load_snapshot


def run_suggest(path: str, output_format: str, top: int, stdout=None) -> int:
    stdout = stdout or sys.stdout
    loaded = load_snapshot(path)
    document = loaded.document
    if output_format == "json":
        result = analysis(document, top=top, source_format=loaded.source_format, path=path)
        stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")
    elif output_format == "markdown":
        stdout.write(report.render_markdown(document, top=top))
    else:
        stdout.write(report.render_text(document, top=top).lstrip("\n"))
    return 0
