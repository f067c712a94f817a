"""`oomdoc suggest`: load any accepted snapshot (or the rank snapshots of one
distributed job), analyse it, print it."""

from __future__ import annotations

import os
import sys
from typing import TextIO, Union

from oomdoc.analysis import analyse
from oomdoc.errors import UsageError
from oomdoc.loaders import LoadedSnapshot, load_snapshot
from oomdoc.output_paths import write_new_file
from oomdoc.reporters import render


def run_suggest(
    path: Union[str, list[str]],
    output_format: str,
    top: int,
    stdout: TextIO | None = None,
    output: str | None = None,
) -> int:
    """Print (or, with `output`, write) the report of the snapshot at `path`;
    several paths, or a directory, are the ranks of one job, merged."""
    stdout = stdout or sys.stdout
    if not isinstance(path, str):
        seen: dict[str, str] = {}
        for given in path:
            same = seen.setdefault(os.path.realpath(given), given)
            if same != given or path.count(given) > 1:
                raise UsageError(
                    f"{given}: the same snapshot given twice (as {same}); each rank's snapshot once"
                )
    if not isinstance(path, str) or os.path.isdir(path):
        from oomdoc.distributed.merge import load_job

        paths = [path] if isinstance(path, str) else list(path)
        loaded, path = LoadedSnapshot(load_job(paths), "oomdoc"), paths[0]
    else:
        loaded = load_snapshot(path)
    analysis = analyse(loaded.snapshot, top=top, source_format=loaded.source_format, path=path)
    text = render(output_format, analysis)
    if output_format == "table":
        text = text.lstrip("\n")
    if output:
        written = write_new_file(output, text)
        print(f"oomdoc: wrote {written}", file=sys.stderr)
    else:
        stdout.write(text)
    return 0
