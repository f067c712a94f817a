"""Formatting helpers shared by the diagnosis (its evidence sentences) and the
reporters: below both, importing neither. Bytes are humanised by
oomdoc.sizes.format_bytes; this module turns records into short phrases."""

from __future__ import annotations

import os
import re
from typing import Optional

from oomdoc.model import Location, Site


def percent(part: int, whole: int, decimals: int = 1) -> str:
    """`42.0%` of a whole; `-` when the whole is unknown."""
    return f"{100.0 * part / whole:.{decimals}f}%" if whole else "-"


def relative_path(filename: str, relative_to: Optional[str]) -> str:
    """`filename` relative to `relative_to` when it lies under it, else unchanged."""
    if relative_to:
        try:
            relative = os.path.relpath(filename, relative_to)
            if not relative.startswith(".."):
                return relative
        except ValueError:
            pass
    return filename


def format_location(location: Optional[Location], relative_to: Optional[str] = None) -> str:
    """`train.py:12 in main`, or `(unknown)`."""
    if location is None:
        return "(unknown)"
    return f"{relative_path(location.file, relative_to)}:{location.line} in {location.function}"


def tensor_description(site: Site) -> str:
    """`4 x 4096x512 float32`: how many tensors (or blocks) of which shape."""
    shape_text = "x".join(str(d) for d in site.shape) if site.shape else ""
    kind = " ".join(part for part in (shape_text, site.dtype or "") if part)
    count = site.count
    if not kind:  # the CUDA allocator knows blocks, not shapes
        return f"{count} block" + ("s" if count > 1 else "")
    return (f"{count} x " if count > 1 else "") + kind


def index_list(indices: list[int], limit: int = 6) -> str:
    """`1, 2, 3, ... (40 in all)`."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


# Control characters, but the line breaks and tabs a report is made of.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with control characters written out (`\\x1b`): a snapshot's
    strings (file names, messages) come from anywhere, and an escape
    sequence printed raw would recolour or rewrite the user's terminal."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
