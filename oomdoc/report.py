"""Rendering a snapshot for people: terminal text and Markdown.

`oomdoc run`, `oomdoc suggest` and `oomdoc check` all render through here, so a
snapshot reads the same wherever it is shown. Bytes are humanised only here.
"""

from __future__ import annotations

import os

from tabulate import tabulate

from oomdoc.diagnose import diagnose, fixes_for
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
    source = (document.get("source") or {}).get("format", "")
    if outcome == "oom" and document.get("oom"):
        oom = document["oom"]
        step, phase = oom.get("step"), oom.get("phase")
        where = " ".join(
            part
            for part in (
                f"in step {step}" if step is not None else "",
                f"during {phase}" if phase else "",
            )
            if part
        )
        return (
            f"OOM{' ' + where if where else ''}: tried to allocate {format_bytes(oom.get('requested_bytes'))} "
            f"with {format_bytes(oom.get('allocated_bytes'))} of {format_bytes(capacity)} in use"
        )
    if source.startswith("torch"):
        peak = document.get("peak") or {}
        return (
            f"PyTorch memory snapshot without an OOM: {format_bytes(peak.get('allocated_bytes'))} allocated, "
            f"{format_bytes(peak.get('reserved_bytes'))} reserved"
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
    rows = [
        [c, format_bytes(breakdown.get(c, 0)), _percent(breakdown.get(c, 0), capacity)]
        for c in CATEGORIES
    ]
    rows.append(["total", format_bytes(total), _percent(total, capacity)])
    return rows


def site_rows(document: dict, limit: int = 5) -> list[list[str]]:
    relative_to = document.get("cwd")
    rows = []
    for site in (document.get("top_allocations") or [])[:limit]:
        rows.append(
            [
                format_bytes(site.get("bytes")),
                site.get("category", "?"),
                format_location(site.get("location"), relative_to),
                tensor_description(site),
            ]
        )
    return rows


def tensor_description(site: dict) -> str:
    """`4 x 4096x512 float32`: how many tensors (or blocks) of which shape."""
    shape = site.get("shape")
    shape_text = "x".join(str(d) for d in shape) if isinstance(shape, list) and shape else ""
    count = site.get("count") if isinstance(site.get("count"), int) else 1
    kind = " ".join(
        p
        for p in (shape_text, site.get("dtype") if isinstance(site.get("dtype"), str) else "")
        if p
    )
    if not kind:  # the CUDA allocator knows blocks, not shapes
        return f"{count} block" + ("s" if count > 1 else "")
    return (f"{count} x " if count > 1 else "") + kind


def _breakdown_title(document: dict) -> str:
    device = document.get("device") or {}
    what = (
        "the simulated device"
        if device.get("kind") == "simulated"
        else (device.get("name") or "the GPU")
    )
    moment = {"oom": "at the OOM", "peak": "at the peak", "snapshot": "in the snapshot"}.get(
        document.get("breakdown_at"), "at the end"
    )
    return f"What filled {what} ({moment})"


def render_text(document: dict, snapshot_path: str | None = None, top: int = 5) -> str:
    """The report printed on stderr after `oomdoc run`."""
    lines = ["", f"oomdoc: {headline(document)}"]
    oom = document.get("oom") or {}
    if document.get("outcome") == "oom" and oom.get("location"):
        lines.append(f"  at {format_location(oom['location'], document.get('cwd'))}")
    lines.append("")
    lines.append(_breakdown_title(document))
    lines.append(
        tabulate(
            breakdown_rows(document),
            headers=["category", "bytes", "% of capacity"],
            colalign=("left", "right", "right"),
        )
    )
    sites = site_rows(document, top)
    if sites:
        lines.append("")
        lines.append(f"Top {len(sites)} allocation sites")
        lines.append(
            tabulate(
                sites,
                headers=["bytes", "category", "location", "tensors"],
                colalign=("right", "left", "left", "left"),
            )
        )
    lines.extend(_trace_lines(document))
    lines.extend(diagnosis_lines(document))
    lines.extend(fix_lines(document, top))
    for note in _notes(document):
        lines.append(f"note: {note}")
    if snapshot_path:
        lines.append("")
        lines.append(f"Snapshot: {snapshot_path}")
        torch_snapshot = (document.get("artifacts") or {}).get("torch_snapshot_file")
        if torch_snapshot:
            lines.append(
                f"PyTorch memory snapshot (drag into https://pytorch.org/memory_viz): {torch_snapshot}"
            )
    return "\n".join(lines) + "\n"


def _notes(document: dict) -> list[str]:
    notes = []
    device = document.get("device") or {}
    if device.get("kind") == "simulated":
        notes.append(
            "on the simulated device every CPU tensor of the script counts against the capacity."
        )
    notes.extend(document.get("notes") or [])
    return notes


def render_markdown(document: dict, top: int = 5) -> str:
    lines = [f"**oomdoc:** {headline(document)}", ""]
    oom = document.get("oom") or {}
    if document.get("outcome") == "oom" and oom.get("location"):
        lines += [f"at `{format_location(oom['location'], document.get('cwd'))}`", ""]
    lines.append(f"### {_breakdown_title(document)}")
    lines.append(
        tabulate(
            breakdown_rows(document),
            headers=["category", "bytes", "% of capacity"],
            tablefmt="github",
        )
    )
    sites = site_rows(document, top)
    if sites:
        lines += ["", "### Top allocation sites"]
        lines.append(
            tabulate(sites, headers=["bytes", "category", "location", "tensors"], tablefmt="github")
        )
    trace = _trace_rows(document)
    if trace:
        lines += ["", "### Allocator events before the OOM"]
        lines.append(
            tabulate(trace, headers=["action", "bytes", "category", "location"], tablefmt="github")
        )
    diagnoses = diagnose(document)
    if diagnoses:
        lines += ["", "### Diagnosis"]
        for number, item in enumerate(diagnoses, 1):
            lines.append(f"{number}. **{item['kind']}**: {item['summary']}")
            for line in item["evidence"]:
                lines.append(f"   - {line}")
            if item.get("remedy"):
                lines += [
                    "",
                    "   ```python",
                    *[f"   {code}" for code in item["remedy"].splitlines()],
                    "   ```",
                ]
    fixes, measured = _shown_fixes(document)
    if fixes and measured:
        lines += ["", f"### {_fixes_title(measured)}"]
        lines.extend(f"> {note}\n" for note in _bug_first_note(document))
        lines.extend(measured_fix_lines(document, fixes, markdown=True))
    elif fixes:
        lines += ["", f"### {_fixes_title(measured)}"]
        lines.extend(f"> {note}\n" for note in _bug_first_note(document))
        lines.append(tabulate(fix_rows(fixes[:top]), headers=FIX_HEADERS, tablefmt="github"))
        lines += _first_fix_snippet(fixes, fence=True)
    for note in _notes(document):
        lines.append(f"\n> {note}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------ diagnoses and fixes


def diagnosis_lines(document: dict) -> list[str]:
    """The diagnoses, most important first: what `oomdoc run` and
    `oomdoc suggest` both print."""
    diagnoses = diagnose(document)
    if not diagnoses:
        return []
    lines = ["", "Diagnosis (most important first)"]
    for number, item in enumerate(diagnoses, 1):
        lines.append(f"{number}. {item['kind']}: {item['summary']}")
        for line in item["evidence"]:
            lines.append(f"     - {line}")
        if item.get("remedy"):
            lines.append("     fix:")
            lines.extend(f"       {code}" for code in item["remedy"].splitlines())
        elif item.get("fixes"):
            lines.append(f"     fixes: {', '.join(item['fixes'])}")
    return lines


FIX_HEADERS = ["fix", "peak", "saved", "fits", "step time", "how known"]


def _shown_fixes(document: dict) -> tuple[list[dict], bool]:
    """Measured fixes whenever the snapshot has them; estimates only for an
    OOM (on a run that fit they would only be noise)."""
    fixes, measured = fixes_for(document)
    if not measured and document.get("outcome") != "oom" and not document.get("fixes"):
        return [], False
    return fixes, measured


BUG_KINDS = ("grad_in_eval", "leak")


def _bug_first_note(document: dict) -> list[str]:
    """When the first diagnosis is a bug, the fixes below treat memory the bug
    wastes as needed: say so above them."""
    diagnoses = diagnose(document)
    if diagnoses and diagnoses[0]["kind"] in BUG_KINDS:
        return [
            f"fix the {diagnoses[0]['kind']} above first; these fixes treat the memory it wastes as needed."
        ]
    return []


def _fixes_title(measured: bool) -> str:
    if measured:
        return "Fixes, measured by replaying the failing step"
    return "Fixes, estimated from the breakdown (not measured: `oomdoc run` replays measure them)"


def fix_rows(fixes: list[dict]) -> list[list[str]]:
    """One row per fix, measured or estimated alike."""
    rows = []
    for fix in fixes:
        ratio = fix.get("step_time_ratio")
        fits = fix.get("fits")
        rows.append(
            [
                fix.get("name", "?"),
                format_bytes(fix.get("peak_allocated_bytes"))
                if isinstance(fix.get("peak_allocated_bytes"), int)
                else "?",
                format_bytes(fix.get("saved_bytes"))
                if isinstance(fix.get("saved_bytes"), int)
                else "?",
                "yes" if fits is True else ("no" if fits is False else "?"),
                f"{ratio:.2f}x"
                if isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                else "-",
                "measured" if fix.get("measured") is not False else "estimated",
            ]
        )
    return rows


def _first_fix_snippet(fixes: list[dict], fence: bool = False) -> list[str]:
    first = next((fix for fix in fixes if fix.get("fits")), fixes[0] if fixes else None)
    snippet = (first or {}).get("snippet")
    if not isinstance(snippet, str) or not snippet:
        return []
    head = f"How to apply {first.get('name')}:"
    if fence:
        return ["", head, "", "```python", snippet, "```"]
    return ["", head, *(f"    {line}" for line in snippet.splitlines())]


def fix_lines(document: dict, top: int = 5) -> list[str]:
    fixes, measured = _shown_fixes(document)
    if not fixes:
        return []
    lines = ["", _fixes_title(measured)]
    lines.extend(f"note: {note}" for note in _bug_first_note(document))
    if measured:
        return lines + measured_fix_lines(document, fixes)
    lines.append(tabulate(fix_rows(fixes[:top]), headers=FIX_HEADERS))
    for fix in fixes[:top]:
        if fix.get("detail"):
            lines.append(f"  {fix.get('name')}: {fix['detail']}")
    lines.extend(_first_fix_snippet(fixes))
    return lines


MEASURED_FIX_HEADERS = ["rank", "fix", "peak", "saved", "% of need", "fits", "step time"]


def measured_fix_rows(document: dict, fixes: list[dict]) -> list[list[str]]:
    """Rank, fix, peak, saved (bytes and % of the failing run's need), fits,
    step-time ratio. A fix that ran out of memory shows what it needed then."""
    need = (document.get("replay") or {}).get("baseline_need_bytes")
    rows = []
    for position, fix in enumerate(fixes, start=1):
        peak = fix.get("peak_allocated_bytes")
        fits = fix.get("fits")
        saved = fix.get("saved_bytes")
        ratio = fix.get("step_time_ratio")
        if not isinstance(peak, int):
            peak_text = "-"
        else:
            peak_text = format_bytes(peak) if fits else f"> {format_bytes(peak)}"
        fits_text = (
            "yes"
            if fits
            else {"timeout": "timed out", "error": "failed"}.get(fix.get("outcome"), "no")
        )
        rows.append(
            [
                str(fix.get("rank", position)),
                fix.get("name", "?"),
                peak_text,
                format_bytes(saved) if isinstance(saved, int) else "-",
                _percent(saved, need)
                if isinstance(saved, int) and isinstance(need, int) and need
                else "-",
                fits_text,
                f"{ratio:.2f}x"
                if isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                else "-",
            ]
        )
    return rows


def measured_fix_lines(document: dict, fixes: list[dict], markdown: bool = False) -> list[str]:
    """The ranked table of replayed fixes, what they are measured against,
    the fixes not tried and why, then every fix's detail and snippet."""
    replay = document.get("replay") or {}
    lines = [
        tabulate(
            measured_fix_rows(document, fixes),
            headers=MEASURED_FIX_HEADERS,
            tablefmt="github" if markdown else "simple",
            colalign=("right", "left", "right", "right", "right", "left", "right"),
        )
    ]
    need = replay.get("baseline_need_bytes")
    batch = (replay.get("batch_search") or {}).get("original_batch_size")
    at = f" at batch size {batch}" if batch else ""
    if isinstance(need, int) and need:
        capacity = format_bytes((document.get("device") or {}).get("capacity_bytes"))
        if replay.get("baseline_need_estimated"):
            lines.append(
                f"Need of the failing run{at}: {format_bytes(need)} (ESTIMATE from the batch-size model); capacity {capacity}"
            )
        else:
            lines.append(
                f"Need of the failing run{at}: at least {format_bytes(need)} (what it held when it failed); capacity {capacity}"
            )
    maximum = document.get("max_batch_size")
    if isinstance(maximum, int) and maximum > 0:
        lines.append(
            f"Largest batch size that fits: {maximum} (measured: {maximum + 1} ran out of memory)"
        )
    if replay.get("reference_step_s"):
        lines.append(f"Step time relative to {replay.get('reference')}")
    for skipped in replay.get("skipped") or []:
        lines.append(f"not tried: {skipped.get('name')}: {skipped.get('reason')}")
    if replay:
        lines.append(
            f"{replay.get('replays', 0)} replays in {replay.get('total_s', 0):.1f} s "
            f"(each ran {replay.get('max_steps', 2)} steps with OOMDOC_REPLAY=1)"
        )
    for position, fix in enumerate(fixes, start=1):
        lines.append("")
        header = f"{fix.get('rank', position)}. {fix.get('name')}: {fix.get('detail') or fix.get('title') or ''}"
        lines.append(f"**{header}**" if markdown else header)
        snippet = fix.get("snippet")
        if isinstance(snippet, str) and snippet:
            lines += (
                ["```python", snippet, "```"]
                if markdown
                else ["    " + line for line in snippet.splitlines()]
            )
    return lines


def _trace_rows(document: dict) -> list[list[str]]:
    relative_to = document.get("cwd")
    rows = []
    for event in document.get("trace_before_oom") or []:
        rows.append(
            [
                event.get("action", "?"),
                format_bytes(event.get("bytes")),
                event.get("category", "?"),
                format_location(event.get("location"), relative_to)
                if event.get("location")
                else "(no Python stack)",
            ]
        )
    return rows


def _trace_lines(document: dict) -> list[str]:
    rows = _trace_rows(document)
    if not rows:
        return []
    return [
        "",
        "Allocator events just before the OOM (oldest first)",
        tabulate(
            rows,
            headers=["action", "bytes", "category", "location"],
            colalign=("left", "right", "left", "left"),
        ),
    ]
