"""`oomdoc suggest`: load any accepted snapshot, diagnose it, print it."""

from __future__ import annotations

import json
import os
import sys

from oomdoc import report
from oomdoc.diagnose import analysis
from oomdoc.loaders import LoadedSnapshot, load_snapshot


def run_suggest(path: str | list[str], output_format: str, top: int, stdout=None) -> int:
    stdout = stdout or sys.stdout
    if not isinstance(path, str) or os.path.isdir(path):  # one job's ranks (oomdoc.distributed)
        from oomdoc.distributed.merge import load_job

        paths = [path] if isinstance(path, str) else list(path)
        loaded, path = LoadedSnapshot(load_job(paths), "oomdoc"), paths[0]
    else:
        loaded = load_snapshot(path)
    document = loaded.document
    if output_format == "json":
        result = analysis(document, top=top, source_format=loaded.source_format, path=path)
        stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")
    elif output_format == "markdown":
        stdout.write(report.render_markdown(document, top=top))
    else:
        stdout.write(report.render_text(document, top=top).lstrip("\n"))
        if document.get("ranks"):  # until the reporters show ranks (oomdoc.distributed)
            from oomdoc.distributed.report import diagnosis_lines, rank_section_lines
            from oomdoc.distributed.rules import diagnose_distributed

            extra = rank_section_lines(document) + diagnosis_lines(diagnose_distributed(document))
            stdout.write("\n".join(extra) + "\n")
    return 0
