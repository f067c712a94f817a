"""Rendering a snapshot for people: terminal text and Markdown.

`oomdoc run`, `oomdoc suggest` and `oomdoc check` all render through here, so a
snapshot reads the same wherever it is shown. Bytes are humanised only here.
"""

from __future__ import annotations

import os

from tabulate import tabulate

from oomdoc.sizes import format_bytes
from oomdoc.snapshot import CATEGORIES


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def relative_path(filename: str, relative_to: str | None) -> str:
    """`filename` relative to `relative_to` when it lies under it, else unchanged."""
    if relative_to:
        try:
            relative = os.path.relpath(filename, relative_to)
            if not relative.startswith(".."):
                return relative
        except ValueError:
            pass
    return filename


def format_location(location: dict | None, relative_to: str | None = None) -> str:
    if not location:
        return "(unknown)"
    filename = relative_path(location.get("file", "?"), relative_to)
    return f"{filename}:{location.get('line', '?')} in {location.get('function', '?')}"


def headline(document: dict) -> str:
    """One sentence that says what happened."""
    device = document.get("device", {})
    capacity = device.get("capacity_bytes") or 0
    outcome = document.get("outcome")
    if outcome == "oom" and document.get("oom"):
        oom = document["oom"]
        step = oom.get("step")
        where = f"in step {step} during {oom.get('phase')}" if step is not None else f"during {oom.get('phase')}"
        return (
            f"OOM {where}: tried to allocate {format_bytes(oom.get('requested_bytes'))} "
            f"with {format_bytes(oom.get('allocated_bytes'))} of {format_bytes(capacity)} in use"
        )
    peak = document.get("peak") or {}
    peak_allocated = peak.get("allocated_bytes") or 0
    peak_text = (
        f"peak {format_bytes(peak_allocated)} allocated"
        f" ({format_bytes(peak.get('reserved_bytes'))} reserved)"
        f" of {format_bytes(capacity)}"
    )
    if peak.get("step") is not None:
        peak_text += f" in step {peak['step']} during {peak.get('phase')}"
    steps = len(document.get("steps") or [])
    if outcome == "ok":
        return f"The run fit: {peak_text}; headroom {format_bytes(capacity - peak.get('reserved_bytes', peak_allocated))} over {steps} step(s)"
    if outcome == "interrupted":
        return f"Interrupted after {steps} step(s): {peak_text}"
    error = document.get("error") or {}
    failure = error.get("type") or f"exit status {document.get('exit_code')}"
    return f"The script failed ({failure}) after {steps} step(s): {peak_text}"


def breakdown_rows(document: dict) -> list[list[str]]:
    breakdown = document.get("breakdown") or {}
    capacity = (document.get("device") or {}).get("capacity_bytes") or 0
    total = sum(int(breakdown.get(c, 0)) for c in CATEGORIES)
    rows = [[c, format_bytes(breakdown.get(c, 0)), _percent(breakdown.get(c, 0), capacity)] for c in CATEGORIES]
    rows.append(["total", format_bytes(total), _percent(total, capacity)])
    return rows


def site_rows(document: dict, limit: int = 5) -> list[list[str]]:
    relative_to = document.get("cwd")
    rows = []
    for site in (document.get("top_allocations") or [])[:limit]:
        shape = site.get("shape")
        shape_text = "x".join(str(d) for d in shape) if shape else ""
        count = site.get("count") or 1
        rows.append([
            format_bytes(site.get("bytes")),
            site.get("category", "?"),
            format_location(site.get("location"), relative_to),
            (f"{count} x " if count > 1 else "") + " ".join(p for p in (shape_text, site.get("dtype") or "") if p),
        ])
    return rows


def _breakdown_title(document: dict) -> str:
    device = document.get("device") or {}
    what = "the simulated device" if device.get("kind") == "simulated" else (device.get("name") or "the GPU")
    moment = {"oom": "at the OOM", "peak": "at the peak"}.get(document.get("breakdown_at"), "at the end")
    return f"What filled {what} ({moment})"


def render_text(document: dict, snapshot_path: str | None = None, top: int = 5) -> str:
    """The report printed on stderr after `oomdoc run`."""
    lines = ["", f"oomdoc: {headline(document)}"]
    oom = document.get("oom") or {}
    if document.get("outcome") == "oom" and oom.get("location"):
        lines.append(f"  at {format_location(oom['location'], document.get('cwd'))}")
    lines.append("")
    lines.append(_breakdown_title(document))
    lines.append(tabulate(breakdown_rows(document), headers=["category", "bytes", "% of capacity"], colalign=("left", "right", "right")))
    sites = site_rows(document, top)
    if sites:
        lines.append("")
        lines.append(f"Top {len(sites)} allocation sites")
        lines.append(tabulate(sites, headers=["bytes", "category", "location", "tensors"], colalign=("right", "left", "left", "left")))
    for note in _notes(document):
        lines.append(f"note: {note}")
    if snapshot_path:
        lines.append("")
        lines.append(f"Snapshot: {snapshot_path}")
        torch_snapshot = (document.get("artifacts") or {}).get("torch_snapshot_file")
        if torch_snapshot:
            lines.append(f"PyTorch memory snapshot (drag into https://pytorch.org/memory_viz): {torch_snapshot}")
    return "\n".join(lines) + "\n"


def _notes(document: dict) -> list[str]:
    notes = []
    device = document.get("device") or {}
    if device.get("kind") == "simulated":
        notes.append("on the simulated device every CPU tensor of the script counts against the capacity.")
    notes.extend(document.get("notes") or [])
    return notes


def render_markdown(document: dict, top: int = 5) -> str:
    lines = [f"**oomdoc:** {headline(document)}", ""]
    oom = document.get("oom") or {}
    if document.get("outcome") == "oom" and oom.get("location"):
        lines += [f"at `{format_location(oom['location'], document.get('cwd'))}`", ""]
    lines.append(f"### {_breakdown_title(document)}")
    lines.append(tabulate(breakdown_rows(document), headers=["category", "bytes", "% of capacity"], tablefmt="github"))
    sites = site_rows(document, top)
    if sites:
        lines += ["", "### Top allocation sites"]
        lines.append(tabulate(sites, headers=["bytes", "category", "location", "tensors"], tablefmt="github"))
    for note in _notes(document):
        lines.append(f"\n> {note}")
    return "\n".join(lines) + "\n"
