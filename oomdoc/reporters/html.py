"""A self-contained HTML report: one file, readable offline, safe with any snapshot.

Two layers, so that the data source can change without touching the drawing:

`build_view(document, analysis)` is the only function that reads the snapshot
document (a dict as in docs/snapshot.md) and the analysis's JSON form (what
`oomdoc suggest --format json` prints). Every field is read defensively (a field of the wrong type is ignored)
and every list is capped, so the view is small, JSON-safe (ints, finite
floats, strings, lists, dicts, None) and trusted in shape, though not in
content: its strings still come from the snapshot and are escaped when drawn.

`render_html(view)` draws the view: inline CSS, inline SVG drawn here, a little
inline JavaScript (copy buttons, the timeline's hover read-out) and no network
access at view time. Every snapshot string goes through `html.escape`; the
data the script reads is JSON inside `<script type="application/json">` with
`<`, `>`, `&`, U+2028 and U+2029 escaped, and the script writes text with
`textContent` only. Bytes are humanised here, as `oomdoc.sizes.format_bytes`
does.

View keys (bytes are ints; absent values are None):

- `title`, `headline`, `outcome` (`oom`, `ok`, `error`, `interrupted` or `unknown`),
  `command` (one shell-quoted string), `created_at`, `oomdoc_version`,
  `torch_version`, `step_unit`.
- `device`: `name`, `kind`, `capacity_bytes`.
- `oom`: None, or `step`, `phase`, `requested_bytes`, `allocated_bytes`,
  `need_bytes` (allocated + requested), `location` ("file:line in function",
  relative to the run's cwd), `message`.
- `peak`: None, or `allocated_bytes`, `reserved_bytes`, `step`, `phase`.
- `max_batch_size`: int or None.
- `prescription`: None, or `fixes` (names), `batch_size`, `accumulation_steps`,
  `peak_allocated_bytes`, `headroom_bytes`, `fits`, `samples_per_second`,
  `measured`, `snippet` (the document's, else the snippets of its fixes).
- `top_fixes`: up to 3 fix items (as in `fixes.items`), those that fit first.
- `timeline`: `capacity_bytes`, `step_count`, `points_total` (before
  downsampling), `downsampled`, `x_min`, `x_max`, `allocated` (phase peaks:
  `[x, bytes, step, phase]`, x = step + the phase's offset within the step),
  `reserved` (`[x, bytes, step]`, each step's peak reserved), `end`
  (`[x, bytes, step]`, allocated at each step's end), `reserved_is_allocated`
  (the simulated device: reserved adds nothing), `growth_per_step_bytes`
  (end-of-step growth over the complete steps, None when not growing),
  `oom` (None or `x`, `step`, `phase`, `allocated_bytes`, `need_bytes`), `peak`
  (None or `x`, `step`, `phase`, `bytes`).
- `breakdown`: `label` ("at the OOM", ...), `at`, `capacity_bytes`,
  `total_bytes`, `requested_bytes` (0 unless at an OOM), `categories`
  (`[{name, bytes}]` in the snapshot's category order).
- `modules`: None, or `items` (`path`, `class`, `blocks`, `bytes` per category,
  `total_bytes`; largest first, capped) and `total` (how many the snapshot has).
- `sites`: `items` (`bytes`, `count`, `category`, `location`, `tensors`,
  `stack`: list of "file:line in function" strings, capped) and `total`.
- `fixes`: `measured`, `capacity_bytes`, `need_bytes`, `need_estimated`,
  `max_batch_size`, `skipped` (`[{name, reason}]`), `items` (`name`, `rank`,
  `measured`, `peak_allocated_bytes`, `saved_bytes`, `fits` (True, False or
  None), `status` (`fits`, `out of memory`, `timed out`, `failed`,
  `does not fit`, `unknown`), `step_time_ratio`, `detail`, `snippet`).
- `diagnoses`: `[{kind, summary, evidence, bytes, fixes, remedy}]`.
- `notes`: list of strings.
- `ranks`: None, or `world_size`, `first_failing_rank`, `items` (`rank`,
  `local_rank`, `host`, `device` (`name`, `kind`, `capacity_bytes`), `outcome`,
  `oom` (as above, or None), `breakdown` (`[{name, bytes}]`), `total_bytes`,
  `peak_allocated_bytes`, `steps` (`[step, peak allocated]`, downsampled)).
"""

from __future__ import annotations

import gc
import html
import json
import math
import os
import shlex
from typing import TYPE_CHECKING

from oomdoc.model import CATEGORIES
from oomdoc.sizes import format_bytes

if TYPE_CHECKING:
    from oomdoc.analysis import Analysis

# Caps that keep the file small and fast whatever the snapshot holds.
MAX_TIMELINE_POINTS = 1600  # per series; min and max per bucket are kept
MAX_RANK_STEP_POINTS = 120
MAX_SITES = 50
MAX_STACK_FRAMES = 30
MAX_MODULES = 25
MAX_RANKS = 128
MAX_DIAGNOSES = 20
MAX_NOTES = 20
MAX_SKIPPED = 20
MAX_FIXES = 20
MAX_TEXT = 4000  # characters of any one string (messages, snippets)
MAX_LIST_TEXT = 20  # evidence lines per diagnosis
DRAW_DOTS_UP_TO = 48  # phase-peak dots are drawn only up to this many points
DRAW_END_MARKERS_UP_TO = 24  # and end-of-step markers up to this many steps

# Where each phase sits within its step on the timeline's x axis.
PHASE_OFFSETS = {
    "setup": 0.05,
    "forward": 0.25,
    "backward": 0.5,
    "optimizer": 0.72,
    "idle": 0.9,
    "evaluation": 0.95,
    "communication": 0.1,
}
END_OFFSET = 0.8  # right after the step's optimizer.step()
PHASE_COLORS = {
    "setup": "#64748b",
    "forward": "#2563eb",
    "backward": "#7c3aed",
    "optimizer": "#d97706",
    "idle": "#0d9488",
    "evaluation": "#db2777",
    "communication": "#059669",
}
CATEGORY_COLORS = {
    "parameters": "#3b82f6",
    "gradients": "#14b8a6",
    "optimizer_state": "#f59e0b",
    "activations": "#8b5cf6",
    "other": "#94a3b8",
}

# ------------------------------------------------------------ safe reading


def _int(value, default=None):
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _num(value, default=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return float(value) if math.isfinite(value) else default


def _str(value, default=None, limit: int = MAX_TEXT):
    if not isinstance(value, str):
        return default
    return value if len(value) <= limit else value[: limit - 1] + "\u2026"


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _dicts(value) -> list:
    return [item for item in _list(value) if isinstance(item, dict)]


def _strs(value, limit: int) -> list:
    return [text for text in (_str(item) for item in _list(value)[:limit]) if text is not None]


def _bool(value):
    return value if isinstance(value, bool) else None


def _relative(filename: str, cwd) -> str:
    if isinstance(cwd, str) and cwd and os.path.isabs(filename):
        try:
            relative = os.path.relpath(filename, cwd)
            if not relative.startswith(".."):
                return relative
        except ValueError:
            pass
    return filename


def _location(location, cwd=None):
    """`file:line in function`, relative to the run's cwd, or None."""
    if isinstance(location, str):
        return _str(location, limit=420)
    location = _dict(location)
    filename = _str(location.get("file"), limit=300) or _str(location.get("filename"), limit=300)
    if not filename:
        return None
    line = _int(location.get("line"))
    function = _str(location.get("function"), limit=120) or _str(location.get("name"), limit=120)
    text = _relative(filename, cwd)
    if line is not None:
        text += f":{line}"
    if function:
        text += f" in {function}"
    return text


# ----------------------------------------------------------------- the view


def build_view(document: dict, analysis: dict) -> dict:
    """The report's data, read once from the snapshot and its analysis; see
    the module docstring for the keys."""
    # The view is acyclic; pausing the cycle collector while it is built
    # halves the time on big snapshots (it would walk the whole document).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _build_view(_dict(document), _dict(analysis))
    finally:
        if collecting:
            gc.enable()


def _build_view(document: dict, analysis: dict) -> dict:
    document = _dict(document)
    analysis = _dict(analysis)
    device = _dict(document.get("device"))
    analysed_device = _dict(analysis.get("device"))
    capacity = (
        _int(device.get("capacity_bytes"))
        or _int(analysed_device.get("capacity_bytes"))
        or _int(_dict(document.get("oom")).get("capacity_bytes"))
        or 0
    )
    cwd = document.get("cwd")
    fixes = _fix_items(document, analysis)
    return {
        "title": _title(document),
        "headline": _str(analysis.get("headline"), "") or "",
        "outcome": _str(document.get("outcome"), "unknown", 40),
        "command": _command(document.get("command")),
        "created_at": _str(document.get("created_at"), limit=80),
        "oomdoc_version": _str(document.get("oomdoc_version"), limit=80),
        "torch_version": _str(document.get("torch_version"), limit=80),
        "step_unit": _str(document.get("step_unit"), limit=40),
        "device": {
            "name": _str(device.get("name"), limit=200)
            or _str(analysed_device.get("name"), limit=200)
            or "device",
            "kind": _str(device.get("kind"), limit=40)
            or _str(analysed_device.get("kind"), limit=40),
            "capacity_bytes": capacity,
        },
        "oom": _oom(document.get("oom"), cwd) if document.get("outcome") == "oom" else None,
        "peak": _peak(document.get("peak")),
        "max_batch_size": _int(document.get("max_batch_size")),
        "prescription": _prescription(document, capacity),
        "top_fixes": sorted(fixes["items"], key=lambda fix: fix["fits"] is not True)[:3],
        "timeline": _timeline(document, capacity),
        "breakdown": _breakdown(document, analysis, capacity),
        "modules": _modules(document.get("modules")),
        "sites": _sites(document.get("top_allocations"), cwd),
        "fixes": fixes,
        "diagnoses": _diagnoses(analysis.get("diagnoses")),
        "notes": _notes(document),
        "ranks": _ranks(document, cwd),
    }


def _title(document: dict) -> str:
    command = [part for part in _list(document.get("command")) if isinstance(part, str)]
    if command and command[0] == "-m" and len(command) > 1:
        name = command[1]
    elif command:
        name = os.path.basename(command[0])
    else:
        name = "snapshot"
    return _str(f"oomdoc: {name}", limit=200) or "oomdoc"


def _command(command) -> str:
    parts = [part for part in _list(command) if isinstance(part, str)]
    return _str(" ".join(shlex.quote(part) for part in parts), "") or ""


def _oom(oom, cwd):
    oom = _dict(oom)
    if not oom:
        return None
    allocated = _int(oom.get("allocated_bytes"))
    requested = _int(oom.get("requested_bytes"))
    return {
        "step": _int(oom.get("step")),
        "phase": _str(oom.get("phase"), limit=40),
        "requested_bytes": requested,
        "allocated_bytes": allocated,
        "need_bytes": (allocated or 0) + (requested or 0) if allocated is not None else None,
        "location": _location(oom.get("location"), cwd),
        "message": _str(oom.get("message")),
    }


def _peak(peak):
    peak = _dict(peak)
    if not peak:
        return None
    return {
        "allocated_bytes": _int(peak.get("allocated_bytes")),
        "reserved_bytes": _int(peak.get("reserved_bytes")),
        "step": _int(peak.get("step")),
        "phase": _str(peak.get("phase"), limit=40),
    }


def _prescription(document: dict, capacity: int):
    prescription = _dict(document.get("prescription"))
    if not prescription:
        return None
    names = _strs(prescription.get("fixes"), 10)
    peak = _int(prescription.get("peak_allocated_bytes"))
    snippet = _str(prescription.get("snippet"))
    if not snippet:
        by_name = {fix.get("name"): fix for fix in _dicts(document.get("fixes"))}
        parts = []
        for name in names:
            fix_snippet = _str(_dict(by_name.get(name)).get("snippet"))
            if fix_snippet:
                parts.append(f"# {name}\n{fix_snippet}")
        snippet = _str("\n\n".join(parts)) or None
    return {
        "fixes": names,
        "batch_size": _int(prescription.get("batch_size")),
        "accumulation_steps": _int(prescription.get("accumulation_steps")),
        "peak_allocated_bytes": peak,
        "headroom_bytes": capacity - peak if peak is not None and capacity else None,
        "fits": _bool(prescription.get("fits")),
        "samples_per_second": _num(prescription.get("samples_per_second")),
        "throughput_batch_size": _int(prescription.get("throughput_batch_size")),
        "measured": _bool(prescription.get("measured")),
        "snippet": snippet,
        "kind": _str(prescription.get("kind"), limit=20),
        "detail": _str(prescription.get("detail"), limit=2000),
        "accumulation_measured": _bool(prescription.get("accumulation_measured")),
        "verified_by_flags": _flags_replay(_dict(prescription.get("verified_by_flags"))),
    }


def _flags_replay(record: dict) -> dict | None:
    """The prescription replayed with the script's own flags (or None)."""
    if not record or not isinstance(record.get("args"), list):
        return None
    return {
        "args": " ".join(_strs(record.get("args"), 40)),
        "outcome": _str(record.get("outcome"), limit=40),
        "peak_allocated_bytes": _int(record.get("peak_allocated_bytes")),
        "note": _str(record.get("note"), limit=500),
    }


def _fix_status(fix: dict) -> str:
    fits = fix.get("fits")
    if fits is True:
        return "fits"
    outcome = fix.get("outcome")
    if outcome == "timeout":
        return "timed out"
    if outcome == "error":
        return "failed"
    if fits is False:
        return "out of memory" if fix.get("measured") is not False else "does not fit"
    return "unknown"


def _fix_items(document: dict, analysis: dict) -> dict:
    replay = _dict(document.get("replay"))
    need = _int(replay.get("baseline_need_bytes"))
    if not need:
        need = _int(analysis.get("needed_bytes"))
    fixes = _dicts(analysis.get("fixes"))
    if analysis.get("fixes_measured") is not True and document.get("outcome") != "oom":
        # As the text report: estimates for a run that fit would only be noise.
        fixes = [] if not _list(document.get("fixes")) else fixes
    items = []
    for position, fix in enumerate(fixes[:MAX_FIXES], start=1):
        items.append(
            {
                "name": _str(fix.get("name"), "?", 120),
                "rank": _int(fix.get("rank"), position),
                "measured": fix.get("measured") is not False,
                "peak_allocated_bytes": _int(fix.get("peak_allocated_bytes")),
                "saved_bytes": _int(fix.get("saved_bytes")),
                "fits": _bool(fix.get("fits")),
                "status": _fix_status(fix),
                "step_time_ratio": _num(fix.get("step_time_ratio")),
                "detail": _str(fix.get("detail")) or _str(fix.get("title")),
                "snippet": _str(fix.get("snippet")),
            }
        )
    skipped = [
        {"name": _str(item.get("name"), "?", 120), "reason": _str(item.get("reason"), "")}
        for item in _dicts(replay.get("skipped"))[:MAX_SKIPPED]
    ]
    max_batch = _int(analysis.get("max_batch_size"))
    return {
        "measured": analysis.get("fixes_measured") is True,
        "capacity_bytes": _int(_dict(document.get("device")).get("capacity_bytes")),
        "need_bytes": need,
        "need_estimated": replay.get("baseline_need_estimated") is True,
        "max_batch_size": max_batch if max_batch is not None else None,
        "skipped": skipped,
        "items": items,
    }


# ---------------------------------------------------------------- timeline


def _x(step: int, phase) -> float:
    return step + PHASE_OFFSETS.get(phase, 0.5)


def downsample(points: list, limit: int, keep=()) -> list:
    """At most about `limit` points of a series ordered by x: the lowest and
    the highest of each bucket (so spikes and dips survive), plus the points
    whose x is in `keep` (the OOM, the peak)."""
    if len(points) <= limit:
        return points
    buckets = max(1, limit // 2)
    size = len(points) / buckets
    kept = []
    for bucket in range(buckets):
        chunk = points[int(bucket * size) : int((bucket + 1) * size)]
        if not chunk:
            continue
        low = min(chunk, key=lambda point: point[1])
        high = max(chunk, key=lambda point: point[1])
        kept.extend(sorted({id(low): low, id(high): high}.values(), key=lambda point: point[0]))
    keep = set(keep)
    present = {point[0] for point in kept}
    extra = [point for point in points if point[0] in keep and point[0] not in present]
    if extra:
        kept = sorted(kept + extra, key=lambda point: point[0])
    return kept


def _growth_per_step(ends: list) -> int | None:
    """Least-squares slope of end-of-step allocated bytes over the complete
    steps after the first, when positive: a leak shows as steady growth."""
    values = [value for _, value, _ in ends[1:]]
    if len(values) < 3:
        return None
    count = len(values)
    mean_x = (count - 1) / 2
    mean_y = sum(values) / count
    numerator = sum((index - mean_x) * (value - mean_y) for index, value in enumerate(values))
    denominator = sum((index - mean_x) ** 2 for index in range(count))
    slope = numerator / denominator
    return int(slope) if slope >= 1 else None


def _x_max(xs: list, oom_view) -> float:
    """The end of the last step, or just after the OOM: nothing ran after it."""
    if not xs:
        return 1
    end = math.floor(max(xs)) + 1
    if oom_view and oom_view["x"] >= max(xs):
        return min(end, oom_view["x"] + 0.2)
    return end


def _timeline(document: dict, capacity: int) -> dict:
    steps = sorted(
        (step for step in _dicts(document.get("steps")) if _int(step.get("index")) is not None),
        key=lambda step: step["index"],
    )
    outcome = document.get("outcome")
    allocated, reserved, ends = [], [], []
    last = steps[-1] if steps else None
    # Tight loop: `type(x) is int` is _int without the call (bools excluded).
    for step in steps:
        index = step["index"]
        phase_peaks = step.get("phase_peaks")
        found = False
        if type(phase_peaks) is dict:
            for phase, offset in PHASE_OFFSETS.items():
                value = phase_peaks.get(phase)
                if type(value) is int:
                    allocated.append([index + offset, value, index, phase])
                    found = True
        peak = step.get("peak_allocated_bytes")
        if not found and type(peak) is int:
            phase = _str(step.get("peak_phase"), "backward", 40)
            allocated.append([_x(index, phase), peak, index, phase])
        value = step.get("peak_reserved_bytes")
        if type(value) is int:
            reserved.append([index + 0.5, value, index])
        # The step the run died in has no end: its end bytes are after the unwinding.
        value = step.get("end_allocated_bytes")
        if type(value) is int and not (outcome != "ok" and step is last):
            ends.append([index + END_OFFSET, value, index])
    oom_view = None
    oom = _dict(document.get("oom"))
    if outcome == "oom" and oom:
        step = _int(oom.get("step"), steps[-1]["index"] if steps else 0)
        phase = _str(oom.get("phase"), "forward", 40)
        allocated_at_oom = _int(oom.get("allocated_bytes"), 0)
        oom_view = {
            "x": _x(step, phase),
            "step": step,
            "phase": phase,
            "allocated_bytes": allocated_at_oom,
            "need_bytes": allocated_at_oom + _int(oom.get("requested_bytes"), 0),
        }
        # Nothing ran after the OOM: a phase listed later in its step is not real.
        allocated = [point for point in allocated if point[0] <= oom_view["x"]]
        if not any(point[0] == oom_view["x"] for point in allocated):
            allocated.append([oom_view["x"], allocated_at_oom, step, phase])
            allocated.sort(key=lambda point: point[0])
    peak_view = None
    if allocated:
        highest = max(allocated, key=lambda point: point[1])
        peak_view = {"x": highest[0], "step": highest[2], "phase": highest[3], "bytes": highest[1]}
    per_step_peak: dict[int, int] = {}
    for point in allocated:
        per_step_peak[point[2]] = max(per_step_peak.get(point[2], 0), point[1])
    reserved_is_allocated = all(
        per_step_peak.get(point[2], point[1]) >= point[1] for point in reserved
    )
    keep = [view["x"] for view in (oom_view, peak_view) if view]
    total = len(allocated) + len(reserved) + len(ends)
    shown = {
        "allocated": downsample(allocated, MAX_TIMELINE_POINTS, keep),
        "reserved": downsample(reserved, MAX_TIMELINE_POINTS),
        "end": downsample(ends, MAX_TIMELINE_POINTS),
    }
    xs = [point[0] for series in shown.values() for point in series]
    return {
        "capacity_bytes": capacity,
        "step_count": len(steps),
        "points_total": total,
        "downsampled": sum(len(series) for series in shown.values()) < total,
        "x_min": math.floor(min(xs)) if xs else 0,
        "x_max": _x_max(xs, oom_view),
        **shown,
        "reserved_is_allocated": reserved_is_allocated,
        "growth_per_step_bytes": _growth_per_step(ends),
        "oom": oom_view,
        "peak": peak_view,
    }


# --------------------------------------------------- breakdown, modules, sites


def _breakdown(document: dict, analysis: dict, capacity: int) -> dict:
    source = _dict(analysis.get("breakdown")) or _dict(document.get("breakdown"))
    categories = [
        {"name": category, "bytes": max(0, _int(source.get(category), 0))}
        for category in CATEGORIES
    ]
    at = _str(analysis.get("breakdown_at"), limit=40) or _str(
        document.get("breakdown_at"), limit=40
    )
    oom = _dict(document.get("oom"))
    is_oom = document.get("outcome") == "oom" and bool(oom)
    label = {
        "oom": "at the OOM",
        "peak": "at the peak",
        "end": "at the end",
        "snapshot": "in the snapshot",
    }.get(at or "", "at the end")
    return {
        "label": label,
        "at": at,
        "capacity_bytes": capacity,
        "total_bytes": sum(item["bytes"] for item in categories),
        "requested_bytes": max(0, _int(oom.get("requested_bytes"), 0)) if is_oom else 0,
        "categories": categories,
    }


def _category_bytes(item: dict) -> dict:
    nested = _dict(item.get("bytes"))
    source = nested if nested else item
    return {category: max(0, _int(source.get(category), 0)) for category in CATEGORIES}


def _modules(modules):
    if not isinstance(modules, list):
        return None
    items = []
    for module in _dicts(modules):
        by_category = _category_bytes(module)
        total = _int(module.get("total_bytes")) or sum(by_category.values())
        items.append(
            {
                "path": _str(module.get("path"), "?", 300),
                "class": _str(module.get("class"), "", 200),
                "blocks": _int(module.get("blocks"), 1),
                "bytes": by_category,
                "total_bytes": total,
            }
        )
    items.sort(key=lambda item: -item["total_bytes"])
    return {"items": items[:MAX_MODULES], "total": len(items)}


def _tensors(site: dict) -> str:
    """`4 x 4096x512 float32`: how many tensors (or blocks) of which shape."""
    shape = _list(site.get("shape"))
    shape_text = "x".join(str(d) for d in shape if _int(d) is not None)
    count = _int(site.get("count"), 1)
    dtype = _str(site.get("dtype"), "", 40)
    kind = " ".join(part for part in (shape_text, dtype) if part)
    if not kind:
        return f"{count} block" + ("s" if count != 1 else "")
    return (f"{count} x " if count > 1 else "") + kind


def _stack(stack, cwd) -> list:
    frames = []
    for frame in _list(stack)[:MAX_STACK_FRAMES]:
        text = _location(frame, cwd)
        if text:
            frames.append(text)
    return frames


def _sites(sites, cwd) -> dict:
    items = []
    all_sites = _dicts(sites)
    for site in all_sites[:MAX_SITES]:
        items.append(
            {
                "bytes": max(0, _int(site.get("bytes"), 0)),
                "count": _int(site.get("count"), 1),
                "category": _str(site.get("category"), "?", 40),
                "location": _location(site.get("location"), cwd),
                "module": _str(site.get("module"), limit=200),
                "tensors": _tensors(site),
                "stack": _stack(site.get("stack") or site.get("frames"), cwd),
            }
        )
    return {"items": items, "total": len(all_sites)}


def _diagnoses(diagnoses) -> list:
    return [
        {
            "kind": _str(item.get("kind"), "?", 80),
            "summary": _str(item.get("summary"), ""),
            "evidence": _strs(item.get("evidence"), MAX_LIST_TEXT),
            "bytes": _int(item.get("bytes"), 0),
            "fixes": _strs(item.get("fixes"), 10),
            "remedy": _str(item.get("remedy")),
        }
        for item in _dicts(diagnoses)[:MAX_DIAGNOSES]
    ]


def _notes(document: dict) -> list:
    notes = []
    if _dict(document.get("device")).get("kind") == "simulated":
        notes.append(
            "On the simulated device every CPU tensor of the script counts against the capacity."
        )
    notes.extend(_strs(document.get("notes"), MAX_NOTES))
    return notes


def _ranks(document: dict, cwd):
    ranks = document.get("ranks")
    if not isinstance(ranks, list):
        return None
    items = []
    for rank in _dicts(ranks)[:MAX_RANKS]:
        breakdown = _dict(rank.get("breakdown"))
        categories = [
            {"name": category, "bytes": max(0, _int(breakdown.get(category), 0))}
            for category in CATEGORIES
        ]
        steps = sorted(
            (
                [step["index"], _int(step.get("peak_allocated_bytes"), 0)]
                for step in _dicts(rank.get("steps"))
                if _int(step.get("index")) is not None
            ),
            key=lambda point: point[0],
        )
        peak = max((value for _, value in steps), default=None)
        device = _dict(rank.get("device"))
        oom = _oom(rank.get("oom"), cwd)
        items.append(
            {
                "rank": _int(rank.get("rank")),
                "local_rank": _int(rank.get("local_rank")),
                "host": _str(rank.get("host"), limit=200),
                "device": {
                    "name": _str(device.get("name"), limit=200),
                    "kind": _str(device.get("kind"), limit=40),
                    "capacity_bytes": _int(device.get("capacity_bytes")),
                },
                "outcome": _str(rank.get("outcome"), "unknown", 40),
                "oom": oom,
                "breakdown": categories,
                "total_bytes": sum(item["bytes"] for item in categories),
                "peak_allocated_bytes": peak,
                "steps": downsample(steps, MAX_RANK_STEP_POINTS),
            }
        )
    items.sort(key=lambda item: (item["rank"] is None, item["rank"] or 0))
    first = _int(document.get("first_failing_rank"))
    if first is None:
        first = _int(document.get("first_oom_rank"))
    return {
        "world_size": _int(document.get("world_size"), len(items)),
        "first_failing_rank": first,
        "items": items,
    }


# ------------------------------------------------------------------ drawing

_esc = html.escape


def _fmt(value) -> str:
    return format_bytes(value) if isinstance(value, int) else "?"


def _axis_bytes(value: float) -> str:
    """Compact tick labels: `64 MiB`, `1.5 GiB`."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}" if unit != "bytes" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def _nice_byte_step(maximum: float, ticks: int = 5) -> float:
    """A round tick spacing (1, 2, 4, 5, 8 x 2^10k, or decades of those) for
    an axis up to `maximum`."""
    raw = max(maximum, 1) / ticks
    unit = 1024 ** max(0, min(4, int(math.log(max(raw, 1), 1024))))
    for multiple in (
        1,
        2,
        4,
        5,
        8,
        10,
        16,
        20,
        25,
        32,
        40,
        50,
        64,
        100,
        128,
        200,
        256,
        500,
        512,
        1024,
    ):
        if unit * multiple >= raw:
            return float(unit * multiple)
    return float(unit * 1024)


def _nice_int_step(span: float, ticks: int = 10) -> int:
    raw = max(span, 1) / ticks
    magnitude = 10 ** int(math.floor(math.log10(raw))) if raw >= 1 else 1
    for multiple in (1, 2, 5, 10):
        if magnitude * multiple >= raw:
            return max(1, int(magnitude * multiple))
    return max(1, int(magnitude * 10))


def _percent(part, whole) -> str:
    if not isinstance(part, (int, float)) or not whole:
        return "-"
    return f"{100.0 * part / whole:.1f}%"


def _json_for_script(data) -> str:
    """JSON that can sit inside <script type="application/json">: nothing in it
    can close the element or start markup."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _badge(text: str, kind: str) -> str:
    return f'<span class="badge badge-{_esc(kind)}">{_esc(text)}</span>'


def _code_block(text: str, block_id: str) -> str:
    return (
        f'<div class="code"><button type="button" class="copy" data-copy="{_esc(block_id)}" '
        f'title="Copy to the clipboard">Copy</button>'
        f'<pre id="{_esc(block_id)}"><code>{_esc(text)}</code></pre></div>'
    )


class _Ids:
    """Unique element ids for copyable blocks."""

    def __init__(self):
        self.count = 0

    def next(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}-{self.count}"


# -- header and summary


def _outcome_badge(outcome: str) -> str:
    return {
        "oom": _badge("out of memory", "bad"),
        "ok": _badge("fit", "good"),
        "error": _badge("failed", "bad"),
        "interrupted": _badge("interrupted", "warn"),
    }.get(outcome, _badge(outcome or "unknown", "neutral"))


def _stat(label: str, value: str, sub: str = "", kind: str = "") -> str:
    return (
        f'<div class="stat {_esc(kind)}"><div class="stat-label">{_esc(label)}</div>'
        f'<div class="stat-value">{_esc(value)}</div>'
        f'<div class="stat-sub">{_esc(sub)}</div></div>'
    )


def _header(view: dict) -> str:
    device = view["device"]
    meta = []
    if view.get("command"):
        meta.append(
            f'<div><span class="k">command</span> <code>{_esc(view["command"])}</code></div>'
        )
    device_text = f"{device.get('name') or 'device'}"
    if device.get("kind") and device["kind"] not in device_text:
        device_text += f" ({device['kind']})"
    meta.append(
        f'<div><span class="k">device</span> {_esc(device_text)}, capacity '
        f"{_esc(_fmt(device.get('capacity_bytes')))}</div>"
    )
    versions = ", ".join(
        part
        for part in (
            f"torch {view['torch_version']}" if view.get("torch_version") else "",
            f"oomdoc {view['oomdoc_version']}" if view.get("oomdoc_version") else "",
        )
        if part
    )
    when = " · ".join(part for part in (view.get("created_at") or "", versions) if part)
    if when:
        meta.append(f'<div><span class="k">recorded</span> {_esc(when)}</div>')
    oom = view.get("oom")
    callout = ""
    if oom:
        where = (
            f"<div class='oom-where'>at <code>{_esc(oom['location'])}</code></div>"
            if oom.get("location")
            else ""
        )
        message = (
            f"<details class='oom-message'><summary>PyTorch's message</summary>"
            f"<pre>{_esc(oom['message'])}</pre></details>"
            if oom.get("message")
            else ""
        )
        callout = f'<div class="callout bad">{where}{message}</div>'
    return (
        '<header class="top">'
        '<div class="brand">oomdoc <span>memory report</span></div>'
        f'<h1 id="headline">{_outcome_badge(view["outcome"])} {_esc(view["headline"])}</h1>'
        f'<div class="meta">{"".join(meta)}</div>{callout}</header>'
    )


def _stats(view: dict) -> str:
    device = view["device"]
    capacity = device.get("capacity_bytes")
    cards = []
    oom = view.get("oom")
    peak = view.get("peak") or {}
    if oom:
        cards.append(
            _stat(
                "needed at the OOM",
                _fmt(oom.get("need_bytes")),
                f"{_percent(oom.get('need_bytes'), capacity)} of capacity",
                "bad",
            )
        )
        where = " ".join(
            part
            for part in (
                f"step {oom['step']}" if oom.get("step") is not None else "",
                oom.get("phase") or "",
            )
            if part
        )
        cards.append(
            _stat("ran out in", where or "?", f"asked for {_fmt(oom.get('requested_bytes'))}")
        )
    elif peak:
        cards.append(
            _stat(
                "peak allocated",
                _fmt(peak.get("allocated_bytes")),
                f"{_percent(peak.get('allocated_bytes'), capacity)} of capacity",
            )
        )
        if peak.get("step") is not None:
            cards.append(_stat("peak in", f"step {peak['step']} {peak.get('phase') or ''}".strip()))
    cards.append(_stat("capacity", _fmt(capacity), f"{device.get('kind') or 'device'} memory"))
    if view.get("max_batch_size"):
        cards.append(
            _stat(
                "largest batch that fits",
                str(view["max_batch_size"]),
                f"{view['max_batch_size'] + 1} ran out of memory",
                "good",
            )
        )
    fitting = [fix for fix in view["fixes"]["items"] if fix["fits"] is True]
    if view["fixes"]["items"]:
        cards.append(
            _stat(
                "fixes that fit",
                f"{len(fitting)} of {len(view['fixes']['items'])}",
                "measured by replays" if view["fixes"]["measured"] else "estimated",
                "good" if fitting else "",
            )
        )
    return f'<div class="stats">{"".join(cards)}</div>'


def _prescription_section(body: str, prescription: dict, ids: _Ids) -> str:
    snippet = (
        _code_block(prescription["snippet"], ids.next("prescription"))
        if prescription.get("snippet")
        else ""
    )
    return (
        '<section class="card prescription" id="prescription"><h2>Prescription</h2>'
        f"{body}{snippet}</section>"
    )


def _prescription_html(view: dict, ids: _Ids) -> str:
    prescription = view.get("prescription")
    if prescription and prescription.get("kind") == "leak":
        return _prescription_section(
            f'<p class="lead">Fix the leak first {_badge("leak", "bad")}</p>'
            f"<p>{_esc(prescription.get('detail') or '')}</p>",
            prescription,
            ids,
        )
    if prescription:
        names = " + ".join(prescription["fixes"]) or "as it is"
        facts = []
        if prescription.get("batch_size") is not None:
            batch = f"batch size {prescription['batch_size']}"
            if (prescription.get("accumulation_steps") or 1) > 1:
                batch += f" x {prescription['accumulation_steps']} accumulation steps"
            facts.append(batch)
        if prescription.get("peak_allocated_bytes") is not None:
            facts.append(
                f"peak {_fmt(prescription['peak_allocated_bytes'])} of "
                f"{_fmt(view['device'].get('capacity_bytes'))}"
            )
        if prescription.get("headroom_bytes") is not None:
            facts.append(f"headroom {_fmt(prescription['headroom_bytes'])}")
        if prescription.get("samples_per_second") is not None:
            throughput = f"{prescription['samples_per_second']:.1f} samples/s"
            measured_at = prescription.get("throughput_batch_size")
            if measured_at is not None and measured_at != prescription.get("batch_size"):
                throughput += f" (measured at batch {measured_at})"
            facts.append(throughput)
        if prescription.get("accumulation_measured") is True:
            facts.append("peak measured with the gradient accumulation running")
        elif prescription.get("accumulation_measured") is False:
            facts.append("peak of one micro-batch, not measured with the accumulation")
        flags = prescription.get("verified_by_flags")
        if flags:
            verdict = flags.get("outcome") or "?"
            if flags.get("peak_allocated_bytes") is not None:
                verdict += f", peak {_fmt(flags['peak_allocated_bytes'])}"
            facts.append(f"replayed with your script's own flags ({flags['args']}): {verdict}")
        how = {True: "measured", False: "estimated"}.get(prescription.get("measured"), "")
        fits = prescription.get("fits")
        badge = (
            _badge("fits", "good")
            if fits
            else (_badge("does not fit", "bad") if fits is False else "")
        )
        return _prescription_section(
            f'<p class="lead">Use <strong>{_esc(names)}</strong> {badge} '
            f"{_badge(how, 'neutral') if how else ''}</p>"
            f'<ul class="facts">{"".join(f"<li>{_esc(fact)}</li>" for fact in facts)}</ul>',
            prescription,
            ids,
        )
    top = view.get("top_fixes") or []
    if not top:
        return ""
    measured = view["fixes"]["measured"]
    capacity = view["device"].get("capacity_bytes")
    cards = []
    for fix in top:
        ratio = fix.get("step_time_ratio")
        sub = []
        if fix.get("peak_allocated_bytes") is not None:
            prefix = "" if fix["fits"] or not fix["measured"] else "> "
            sub.append(f"peak {prefix}{_fmt(fix['peak_allocated_bytes'])} of {_fmt(capacity)}")
        if fix.get("saved_bytes") is not None:
            sub.append(f"saves {_fmt(fix['saved_bytes'])}")
        if ratio is not None:
            sub.append(f"step time {ratio:.2f}x")
        status = fix["status"]
        cards.append(
            f'<div class="fixcard {"fits" if fix["fits"] else ""}">'
            f'<div class="fixcard-name">{_esc(fix["name"])} '
            f"{_badge(status, 'good' if fix['fits'] else 'bad')}</div>"
            f'<div class="fixcard-sub">{_esc(" · ".join(sub))}</div></div>'
        )
    title = "Best fixes, measured" if measured else "Best fixes, estimated"
    return (
        f'<section class="card" id="best"><h2>{_esc(title)}</h2>'
        f'<div class="fixcards">{"".join(cards)}</div>'
        '<p class="hint"><a href="#fixes">All fixes, with snippets</a></p></section>'
    )


# -- timeline


def _timeline_html(view: dict) -> str:
    timeline = view["timeline"]
    capacity = timeline.get("capacity_bytes") or 0
    allocated = timeline["allocated"]
    reserved = timeline["reserved"]
    ends = timeline["end"]
    oom = timeline.get("oom")
    peak = timeline.get("peak")
    if not allocated and not oom:
        return (
            '<section class="card" id="timeline"><h2>Memory over the run</h2>'
            '<p class="empty">No steps were recorded.</p></section>'
        )
    width, height = 1000, 360
    left, right, top, bottom = 78, 24, 40, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [point[1] for series in (allocated, reserved, ends) for point in series]
    if oom:
        values.append(oom["need_bytes"])
    y_max = max([capacity, *values, 1]) * 1.08
    x_min, x_max = timeline["x_min"], timeline["x_max"]
    if x_max <= x_min:
        x_max = x_min + 1

    def sx(x):
        return left + (x - x_min) / (x_max - x_min) * plot_w

    def sy(y):
        return top + plot_h - (y / y_max) * plot_h

    parts = [
        f'<svg class="chart" id="timeline-svg" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="Memory timeline" preserveAspectRatio="xMidYMid meet">'
    ]
    # Alternate steps shaded, when few enough to tell apart.
    step_span = x_max - x_min
    if step_span <= 80:
        for step in range(int(x_min), math.ceil(x_max)):
            if step % 2 == 0:
                parts.append(
                    f'<rect class="stepband" x="{sx(step):.1f}" y="{top}" '
                    f'width="{sx(min(step + 1, x_max)) - sx(step):.1f}" height="{plot_h}"/>'
                )
    # Grid and y axis.
    y_step = _nice_byte_step(y_max)
    tick = 0.0
    while tick <= y_max:
        y = sy(tick)
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        parts.append(
            f'<text class="tick" x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{_esc(_axis_bytes(tick))}</text>'
        )
        tick += y_step
    # x axis: step numbers.
    x_step = _nice_int_step(step_span)
    first_tick = int(math.ceil(x_min / x_step) * x_step)
    few_steps = step_span <= 4
    for step in range(first_tick, math.ceil(x_max) + 1, x_step):
        if step_span <= 80:  # the label in the middle of the step's band
            if step >= x_max:
                continue
            x = sx((step + min(step + 1, x_max)) / 2)
        elif step > x_max:
            continue
        else:
            x = sx(step)
        label = f"step {step}" if few_steps else str(step)
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{height - bottom + (30 if few_steps else 18)}" '
            f'text-anchor="middle">{label}</text>'
        )
    if few_steps:  # name each phase under its point
        for x, _value, _step, phase in allocated:
            parts.append(
                f'<text class="phase-tick" x="{sx(x):.1f}" y="{height - bottom + 14}" '
                f'text-anchor="middle">{_esc(phase)}</text>'
            )
    if not few_steps:
        parts.append(
            f'<text class="axis-label" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
            'text-anchor="middle">step (each step: forward, backward, optimizer)</text>'
        )
    parts.append(
        f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}"/>'
    )
    parts.append(
        f'<clipPath id="plot-clip"><rect x="{left}" y="0" width="{plot_w}" height="{top + plot_h}"/>'
        '</clipPath><g clip-path="url(#plot-clip)">'
    )
    # Reserved: a light area under each step's peak reserved.
    if reserved and not timeline["reserved_is_allocated"]:
        path = [f"M{sx(reserved[0][0] - 0.5):.1f},{sy(0):.1f}"]
        for x, value, _step in reserved:
            path.append(f"L{sx(x - 0.5):.1f},{sy(value):.1f}L{sx(x + 0.5):.1f},{sy(value):.1f}")
        path.append(f"L{sx(reserved[-1][0] + 0.5):.1f},{sy(0):.1f}Z")
        parts.append(f'<path class="reserved" d="{"".join(path)}"/>')
    # Allocated phase peaks.
    if allocated:
        line = " ".join(f"{sx(point[0]):.1f},{sy(point[1]):.1f}" for point in allocated)
        area = (
            f"M{sx(allocated[0][0]):.1f},{sy(0):.1f} L"
            + " L".join(f"{sx(point[0]):.1f},{sy(point[1]):.1f}" for point in allocated)
            + f" L{sx(allocated[-1][0]):.1f},{sy(0):.1f}Z"
        )
        parts.append(f'<path class="allocated-area" d="{area}"/>')
        parts.append(f'<polyline class="allocated" points="{line}"/>')
    if ends:
        line = " ".join(f"{sx(x):.1f},{sy(value):.1f}" for x, value, _ in ends)
        parts.append(f'<polyline class="end" points="{line}"/>')
    if len(allocated) <= DRAW_DOTS_UP_TO:
        for x, value, step, phase in allocated:
            color = PHASE_COLORS.get(phase, "#334155")
            parts.append(
                f'<circle class="dot" cx="{sx(x):.1f}" cy="{sy(value):.1f}" r="3.6" fill="{color}">'
                f"<title>step {step} {_esc(phase)}: {_esc(_fmt(value))}</title></circle>"
            )
    if ends and len(ends) <= DRAW_END_MARKERS_UP_TO:
        for x, value, step in ends:
            parts.append(
                f'<rect class="enddot" x="{sx(x) - 3:.1f}" y="{sy(value) - 3:.1f}" width="6" height="6">'
                f"<title>end of step {step}: {_esc(_fmt(value))} allocated</title></rect>"
            )
    parts.append("</g>")
    # Capacity: labelled at the end away from the OOM marker.
    if capacity:
        y = sy(capacity)
        parts.append(
            f'<line class="capacity" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        oom_on_left = oom is not None and sx(oom["x"]) < left + plot_w * 0.4
        label_x, anchor = (width - right - 4, "end") if oom_on_left else (left + 6, "start")
        parts.append(
            f'<text class="capacity-label" x="{label_x}" y="{y - 6:.1f}" text-anchor="{anchor}">'
            f"capacity {_esc(_fmt(capacity))}</text>"
        )
    # Peak (when the run did not run out of memory) and the OOM.
    if peak and not oom:
        x, y = sx(peak["x"]), sy(peak["bytes"])
        anchor = "start" if x < left + 90 else ("end" if x > width - right - 90 else "middle")
        parts.append(
            f'<g id="peak-marker" class="peak-marker"><circle cx="{x:.1f}" cy="{y:.1f}" r="6"/>'
            f'<text x="{x:.1f}" y="{y - 11:.1f}" text-anchor="{anchor}">peak {_esc(_fmt(peak["bytes"]))}</text></g>'
        )
    if oom:
        x = sx(oom["x"])
        y_alloc, y_need = sy(oom["allocated_bytes"]), sy(oom["need_bytes"])
        anchor = "end" if x > left + plot_w * 0.6 else "start"
        dx = -12 if anchor == "end" else 12
        parts.append(
            f'<g id="oom-marker" class="oom-marker" data-step="{_esc(str(oom["step"]))}" '
            f'data-phase="{_esc(oom["phase"])}">'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 24}" y2="{top + plot_h}"/>'
            f'<line class="need" x1="{x:.1f}" x2="{x:.1f}" y1="{y_alloc:.1f}" y2="{y_need:.1f}"/>'
            f'<circle cx="{x:.1f}" cy="{y_need:.1f}" r="7"/>'
            f'<path d="M{x - 3.5:.1f},{y_need - 3.5:.1f}l7,7m0,-7l-7,7"/>'
            f'<text x="{x + dx:.1f}" y="{top - 14}" text-anchor="{anchor}">OOM in step {_esc(str(oom["step"]))} '
            f"{_esc(oom['phase'])}: needed {_esc(_fmt(oom['need_bytes']))}</text>"
            f"<title>OOM: {_esc(_fmt(oom['allocated_bytes']))} allocated + "
            f"{_esc(_fmt(oom['need_bytes'] - oom['allocated_bytes']))} requested</title></g>"
        )
    parts.append(
        f'<line id="hover-line" class="hover-line" x1="0" x2="0" y1="{top}" y2="{top + plot_h}" visibility="hidden"/>'
    )
    parts.append("</svg>")
    legend = [
        '<span class="lg"><i class="sw sw-line" style="background:#2563eb"></i>allocated, peak of each phase</span>'
    ]
    if ends:
        legend.append(
            '<span class="lg"><i class="sw sw-dash" style="border-color:#0f172a"></i>allocated at the end of each step</span>'
        )
    if reserved and not timeline["reserved_is_allocated"]:
        legend.append(
            '<span class="lg"><i class="sw" style="background:#bfdbfe"></i>reserved, peak of each step</span>'
        )
    legend.append(
        '<span class="lg"><i class="sw sw-dash" style="border-color:#dc2626"></i>capacity</span>'
    )
    if len(allocated) <= DRAW_DOTS_UP_TO:
        used = []
        for point in allocated:
            if point[3] not in used:
                used.append(point[3])
        for phase in used:
            legend.append(
                f'<span class="lg"><i class="sw sw-dot" style="background:{PHASE_COLORS.get(phase, "#334155")}"></i>{_esc(phase)}</span>'
            )
    notes = []
    growth = timeline.get("growth_per_step_bytes")
    if growth and ends and capacity and growth * timeline["step_count"] >= 0.01 * capacity:
        growth_note = (
            f'<p class="growth" id="growth">Allocated memory at the end of each step grows by '
            f"{_esc(_fmt(growth))} per step: memory kept from step to step (a leak?).</p>"
        )
    else:
        growth_note = ""
    if timeline["reserved_is_allocated"] and reserved:
        notes.append(
            "Reserved equals allocated here (no caching allocator), so only allocated is drawn."
        )
    if timeline["downsampled"]:
        shown = sum(len(timeline[key]) for key in ("allocated", "reserved", "end"))
        notes.append(
            f"{timeline['step_count']} steps: {shown} of {timeline['points_total']} points drawn "
            "(the lowest and highest of each stretch, the peak and the OOM always)."
        )
    data = {
        "left": left,
        "plotW": plot_w,
        "width": width,
        "xMin": x_min,
        "xMax": x_max,
        "allocated": allocated,
        "end": ends,
        "reserved": [] if timeline["reserved_is_allocated"] else reserved,
    }
    return (
        '<section class="card" id="timeline"><h2>Memory over the run</h2>'
        '<p class="sub">Allocated memory at the peak of each phase, step by step, against the capacity.</p>'
        f'<div class="chart-wrap">{"".join(parts)}<div id="tooltip" class="tooltip" hidden></div></div>'
        f'<div class="legend">{"".join(legend)}</div>{growth_note}'
        + "".join(f'<p class="hint">{_esc(note)}</p>' for note in notes)
        + f'<script type="application/json" id="timeline-data">{_json_for_script(data)}</script>'
        "</section>"
    )


# -- breakdown


def _stacked_bar(
    categories: list, scale: int, capacity, requested: int = 0, bar_id: str = ""
) -> str:
    segments = []
    for item in categories:
        if item["bytes"] <= 0 or scale <= 0:
            continue
        share = 100.0 * item["bytes"] / scale
        segments.append(
            f'<div class="seg" data-category="{_esc(item["name"])}" '
            f'style="width:{share:.3f}%;background:{CATEGORY_COLORS.get(item["name"], "#64748b")}" '
            f'title="{_esc(item["name"])}: {_esc(_fmt(item["bytes"]))}"></div>'
        )
    if requested > 0 and scale > 0:
        segments.append(
            f'<div class="seg seg-requested" style="width:{100.0 * requested / scale:.3f}%" '
            f'title="requested at the OOM: {_esc(_fmt(requested))}"></div>'
        )
    marker = ""
    if capacity and scale:
        marker = f'<div class="cap-marker" style="left:{min(100.0, 100.0 * capacity / scale):.3f}%"></div>'
    id_attr = f' id="{_esc(bar_id)}"' if bar_id else ""
    return f'<div class="stack"{id_attr}>{"".join(segments)}{marker}</div>'


def _breakdown_html(view: dict) -> str:
    breakdown = view["breakdown"]
    capacity = breakdown["capacity_bytes"]
    total = breakdown["total_bytes"]
    requested = breakdown["requested_bytes"]
    scale = max(capacity or 0, total + requested, 1)
    rows = []
    for item in breakdown["categories"]:
        color = CATEGORY_COLORS.get(item["name"], "#64748b")
        share_of_total = 100.0 * item["bytes"] / total if total else 0.0
        rows.append(
            f'<tr data-category="{_esc(item["name"])}"><td><i class="sw" style="background:{color}"></i>'
            f'{_esc(item["name"])}</td><td class="num">{_esc(_fmt(item["bytes"]))}</td>'
            f'<td class="num">{_esc(_percent(item["bytes"], capacity))}</td>'
            f'<td class="barcell"><div class="minibar"><div style="width:{share_of_total:.2f}%;background:{color}"></div></div></td></tr>'
        )
    rows.append(
        f'<tr class="total"><td>total</td><td class="num">{_esc(_fmt(total))}</td>'
        f'<td class="num">{_esc(_percent(total, capacity))}</td><td></td></tr>'
    )
    if requested:
        rows.append(
            f'<tr class="requested"><td><i class="sw sw-requested"></i>requested at the OOM</td>'
            f'<td class="num">{_esc(_fmt(requested))}</td><td class="num">{_esc(_percent(requested, capacity))}</td><td></td></tr>'
        )
    where = view["device"].get("name") or "the device"
    if view["device"].get("kind") == "simulated":
        where = "the simulated device"
    return (
        f'<section class="card" id="breakdown"><h2>What filled {_esc(where)} ({_esc(breakdown["label"])})</h2>'
        + _stacked_bar(breakdown["categories"], scale, capacity, requested, "breakdown-bar")
        + f'<div class="stack-scale"><span>0</span><span>capacity {_esc(_fmt(capacity))}</span></div>'
        + '<table class="tbl breakdown-table"><thead><tr><th>category</th><th class="num">bytes</th>'
        '<th class="num">% of capacity</th><th>share of what was in use</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )


# -- modules and sites


def _modules_html(view: dict) -> str:
    modules = view.get("modules")
    if not modules or not modules["items"]:
        return ""
    items = modules["items"]
    scale = max((item["total_bytes"] for item in items), default=1) or 1
    rows = []
    for item in items:
        blocks = f"{item['blocks']} blocks" if item["blocks"] and item["blocks"] > 1 else ""
        segments = "".join(
            f'<div class="seg" style="width:{100.0 * value / scale:.3f}%;background:{CATEGORY_COLORS[name]}" '
            f'title="{_esc(name)}: {_esc(_fmt(value))}"></div>'
            for name, value in item["bytes"].items()
            if value > 0
        )
        cells = "".join(
            f'<td class="num">{_esc(_fmt(item["bytes"][name])) if item["bytes"][name] else "-"}</td>'
            for name in CATEGORIES
        )
        blocks_badge = " " + _badge(blocks, "neutral") if blocks else ""
        rows.append(
            f'<tr><td class="modname"><code>{_esc(item["path"])}</code> <span class="muted">{_esc(item["class"])}</span>'
            f"{blocks_badge}</td>"
            f'<td class="num strong">{_esc(_fmt(item["total_bytes"]))}</td>{cells}'
            f'<td class="barcell"><div class="stack small">{segments}</div></td></tr>'
        )
    headers = "".join(f'<th class="num">{_esc(name)}</th>' for name in CATEGORIES)
    more = (
        f'<p class="hint">The {len(items)} largest of {modules["total"]} modules.</p>'
        if modules["total"] > len(items)
        else ""
    )
    return (
        '<section class="card" id="modules"><h2>Top modules</h2>'
        '<p class="sub">Bytes allocated in each module\'s forward and backward; repeated blocks folded.</p>'
        '<div class="scroll"><table class="tbl modules-table"><thead><tr><th>module</th><th class="num">total</th>'
        f"{headers}<th></th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>{more}</section>"
    )


def _sites_html(view: dict) -> str:
    sites = view["sites"]
    if not sites["items"]:
        return ""
    scale = max((item["bytes"] for item in sites["items"]), default=1) or 1
    rows = []
    for item in sites["items"]:
        color = CATEGORY_COLORS.get(item["category"], "#64748b")
        stack = (
            "<ol class='stack-frames'>"
            + "".join(f"<li><code>{_esc(frame)}</code></li>" for frame in item["stack"])
            + "</ol>"
            if item["stack"]
            else "<p class='muted'>No stack recorded for this site.</p>"
        )
        rows.append(
            '<details class="site"><summary>'
            f'<span class="site-bytes">{_esc(_fmt(item["bytes"]))}</span>'
            f'<span class="site-bar"><i style="width:{100.0 * item["bytes"] / scale:.2f}%;background:{color}"></i></span>'
            f'<span class="site-cat"><i class="sw" style="background:{color}"></i>{_esc(item["category"])}</span>'
            f'<span class="site-loc"><code>{_esc(item["location"] or "(no Python location)")}</code>'
            + (
                f' <span class="site-module">in <code>{_esc(item["module"])}</code></span>'
                if item["module"]
                else ""
            )
            + "</span>"
            f'<span class="site-tensors">{_esc(item["tensors"])}</span>'
            f"</summary>{stack}</details>"
        )
    more = (
        f'<p class="hint">The {len(sites["items"])} largest of {sites["total"]} sites.</p>'
        if sites["total"] > len(sites["items"])
        else ""
    )
    return (
        '<section class="card" id="sites"><h2>Allocation sites</h2>'
        '<p class="sub">Live memory by the line of your code and the module that allocated it; open a row for its stack.</p>'
        '<div class="site-head"><span>bytes</span><span></span><span>category</span><span>location</span><span>tensors</span></div>'
        f"{''.join(rows)}{more}</section>"
    )


# -- fixes, diagnoses, ranks, notes


def _fixes_html(view: dict, ids: _Ids) -> str:
    fixes = view["fixes"]
    if not fixes["items"] and not fixes["skipped"]:
        return ""
    capacity = fixes.get("capacity_bytes") or view["device"].get("capacity_bytes") or 0
    need = fixes.get("need_bytes")
    peaks = [fix["peak_allocated_bytes"] or 0 for fix in fixes["items"]]
    scale = max([capacity, need or 0, *peaks, 1]) * 1.05
    cap_left = 100.0 * capacity / scale if capacity else None
    cap_marker = f'<div class="cap-marker" style="left:{cap_left:.3f}%"></div>' if cap_left else ""
    rows = []
    if need:
        label = "failing run needs" + (" (estimate)" if fixes["need_estimated"] else "")
        rows.append(
            '<div class="fixrow baseline"><div class="fixname">as it is</div>'
            f'<div class="track"><div class="bar bar-need" style="width:{100.0 * need / scale:.3f}%"></div>{cap_marker}</div>'
            f'<div class="fixnums"><strong>{_esc(_fmt(need))}</strong> <span class="muted">{_esc(label)}</span></div></div>'
        )
    for fix in fixes["items"]:
        peak = fix["peak_allocated_bytes"]
        fits = fix["fits"] is True
        width = 100.0 * (peak or 0) / scale
        lower_bound = not fits and fix["measured"] and peak is not None
        bar_class = "bar-fits" if fits else ("bar-lower" if lower_bound else "bar-no")
        if not fix["measured"]:
            bar_class += " bar-estimated"
        peak_text = ("> " if lower_bound else "") + _fmt(peak) if peak is not None else "?"
        nums = [f"<strong>{_esc(peak_text)}</strong>"]
        if fix["saved_bytes"] is not None:
            nums.append(f'<span class="muted">saves {_esc(_fmt(fix["saved_bytes"]))}</span>')
        if fix["step_time_ratio"] is not None:
            nums.append(f'<span class="muted">step time {fix["step_time_ratio"]:.2f}x</span>')
        details = ""
        if fix["detail"] or fix["snippet"]:
            body = f"<p>{_esc(fix['detail'])}</p>" if fix["detail"] else ""
            if fix["snippet"]:
                body += _code_block(fix["snippet"], ids.next("fix"))
            details = f'<details class="fixdetail"{" open" if fits and fix is _first_fitting(fixes) else ""}><summary>how, and what was found</summary>{body}</details>'
        rows.append(
            f'<div class="fixrow{" fits" if fits else ""}" data-fix="{_esc(fix["name"])}" data-fits="{"yes" if fits else "no"}">'
            f'<div class="fixname"><span class="rank">{_esc(str(fix["rank"]))}</span>{_esc(fix["name"])}'
            f"<br>{_badge(fix['status'], 'good' if fits else 'bad')} "
            f"{_badge('measured' if fix['measured'] else 'estimated', 'neutral')}</div>"
            f'<div class="track"><div class="bar {bar_class}" style="width:{width:.3f}%"></div>{cap_marker}</div>'
            f'<div class="fixnums">{" ".join(nums)}</div>{details}</div>'
        )
    facts = []
    if capacity:
        facts.append(f"capacity {_fmt(capacity)} (red line)")
    if fixes.get("max_batch_size"):
        facts.append(
            f"largest batch that fits: {fixes['max_batch_size']} "
            f"({fixes['max_batch_size'] + 1} ran out of memory)"
        )
    skipped = "".join(
        f"<li><strong>{_esc(item['name'])}</strong>: {_esc(item['reason'] or '')}</li>"
        for item in fixes["skipped"]
    )
    title = (
        "Fixes, measured by replaying the failing step"
        if fixes["measured"]
        else "Fixes, estimated from the breakdown (not measured: oomdoc run replays measure them)"
    )
    return (
        f'<section class="card" id="fixes"><h2>{_esc(title)}</h2>'
        f'<p class="sub">Peak memory of each fix against the capacity; green ones fit. {_esc("; ".join(facts))}</p>'
        f'<div class="fixes">{"".join(rows)}</div>'
        + (f'<h3>Not tried</h3><ul class="skipped">{skipped}</ul>' if skipped else "")
        + "</section>"
    )


def _first_fitting(fixes: dict):
    return next((fix for fix in fixes["items"] if fix["fits"] is True), None)


def _diagnoses_html(view: dict, ids: _Ids) -> str:
    diagnoses = view["diagnoses"]
    if not diagnoses:
        return ""
    cards = []
    for number, item in enumerate(diagnoses, start=1):
        kind = item["kind"]
        evidence = "".join(f"<li>{_esc(line)}</li>" for line in item["evidence"])
        remedy = _code_block(item["remedy"], ids.next("remedy")) if item["remedy"] else ""
        fixes = (
            f'<p class="muted">fixes: {_esc(", ".join(item["fixes"]))}</p>'
            if item["fixes"] and not item["remedy"]
            else ""
        )
        bug = kind in ("leak", "grad_in_eval")
        held = f' <span class="muted">{_esc(_fmt(item["bytes"]))}</span>' if item["bytes"] else ""
        evidence_list = f"<ul>{evidence}</ul>" if evidence else ""
        cards.append(
            f'<div class="diag{" bug" if bug else ""}" data-kind="{_esc(kind)}">'
            f'<div class="diag-head"><span class="num-circle">{number}</span>{_badge(kind, "bad" if bug else "neutral")}'
            f"{held}</div>"
            f'<p class="diag-summary">{_esc(item["summary"])}</p>'
            f"{evidence_list}{remedy}{fixes}</div>"
        )
    return (
        '<section class="card" id="diagnoses"><h2>Diagnosis, most important first</h2>'
        f"{''.join(cards)}</section>"
    )


def _rank_oom_text(oom: dict) -> str:
    where = " ".join(
        part
        for part in (
            f"step {oom['step']}" if oom.get("step") is not None else "",
            oom.get("phase") or "",
        )
        if part
    )
    asked = f"asked {_fmt(oom['requested_bytes'])}" if oom.get("requested_bytes") else ""
    return ", ".join(part for part in (where, asked) if part) or "out of memory"


def _ranks_html(view: dict) -> str:
    ranks = view.get("ranks")
    if not ranks or not ranks["items"]:
        return ""
    items = ranks["items"]
    first = ranks.get("first_failing_rank")
    scale = max(
        [item["total_bytes"] for item in items]
        + [item["device"]["capacity_bytes"] or 0 for item in items]
        + [1]
    )
    header = []
    for item in items:
        label = f"rank {item['rank']}" if item["rank"] is not None else "rank ?"
        where = " · ".join(
            part
            for part in (
                item["host"] or "",
                f"local {item['local_rank']}" if item["local_rank"] is not None else "",
            )
            if part
        )
        first_badge = (
            _badge("first to fail", "bad") if first is not None and item["rank"] == first else ""
        )
        header.append(
            f'<th class="rankcol{" first" if first is not None and item["rank"] == first else ""}" '
            f'data-rank="{_esc(str(item["rank"]))}">{_esc(label)}<div class="muted small">{_esc(where)}</div>{first_badge}</th>'
        )

    def row(label: str, cells: list) -> str:
        return f"<tr><th>{_esc(label)}</th>{''.join(f'<td>{cell}</td>' for cell in cells)}</tr>"

    outcome_cells = [
        _badge(
            item["outcome"],
            "bad"
            if item["outcome"] in ("oom", "error")
            else "good"
            if item["outcome"] == "ok"
            else "neutral",
        )
        for item in items
    ]
    oom_cells = [
        _esc(_rank_oom_text(item["oom"])) if item["oom"] else '<span class="muted">-</span>'
        for item in items
    ]
    bars = []
    chart_h = 120
    for item in items:
        capacity = item["device"]["capacity_bytes"]
        y = chart_h
        rects = []
        for category in item["breakdown"]:
            if category["bytes"] <= 0:
                continue
            h = chart_h * category["bytes"] / scale
            y -= h
            rects.append(
                f'<rect x="8" y="{y:.1f}" width="34" height="{h:.1f}" fill="{CATEGORY_COLORS[category["name"]]}">'
                f"<title>{_esc(category['name'])}: {_esc(_fmt(category['bytes']))}</title></rect>"
            )
        if capacity:
            cy = chart_h - chart_h * capacity / scale
            rects.append(f'<line class="capline" x1="2" x2="48" y1="{cy:.1f}" y2="{cy:.1f}"/>')
        bars.append(
            f'<svg class="rankbar" viewBox="0 0 50 {chart_h}" width="50" height="{chart_h}">{"".join(rects)}</svg>'
        )
    sparks = []
    for item in items:
        points = item["steps"]
        if len(points) < 2:
            sparks.append('<span class="muted">-</span>')
            continue
        xs = [point[0] for point in points]
        top = max([point[1] for point in points] + [item["device"]["capacity_bytes"] or 0, 1])
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        line = " ".join(
            f"{2 + 116 * (x - x0) / (x1 - x0):.1f},{38 - 34 * value / top:.1f}"
            for x, value in points
        )
        sparks.append(
            f'<svg class="spark" viewBox="0 0 120 40" width="120" height="40"><polyline points="{line}"/></svg>'
        )
    rows = [
        row("outcome", outcome_cells),
        row("OOM", oom_cells),
        row("peak allocated", [_esc(_fmt(item["peak_allocated_bytes"])) for item in items]),
        row(
            "in use (breakdown)",
            [f"<strong>{_esc(_fmt(item['total_bytes']))}</strong>" for item in items],
        ),
    ]
    for category in CATEGORIES:
        rows.append(
            row(
                category,
                [
                    _esc(_fmt(next(c["bytes"] for c in item["breakdown"] if c["name"] == category)))
                    for item in items
                ],
            )
        )
    rows.append(row("breakdown", bars))
    rows.append(row("peak per step", sparks))
    facts = [f"world size {ranks['world_size']}"] if ranks.get("world_size") is not None else []
    if first is not None:
        facts.append(f"rank {first} ran out of memory first")
    return (
        '<section class="card" id="ranks"><h2>Ranks</h2>'
        f'<p class="sub">{_esc("; ".join(facts))}</p>'
        '<div class="scroll"><table class="tbl ranks-table"><thead><tr><th></th>'
        f"{''.join(header)}</tr></thead><tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def _notes_html(view: dict) -> str:
    if not view["notes"]:
        return ""
    return (
        '<section class="card notes" id="notes"><h2>Notes</h2><ul>'
        + "".join(f"<li>{_esc(note)}</li>" for note in view["notes"])
        + "</ul></section>"
    )


def _nav(view: dict) -> str:
    links = [("timeline", "Timeline"), ("breakdown", "Breakdown")]
    if view.get("ranks") and view["ranks"]["items"]:
        links.append(("ranks", "Ranks"))
    if view["diagnoses"]:
        links.append(("diagnoses", "Diagnosis"))
    if view.get("modules") and view["modules"]["items"]:
        links.append(("modules", "Modules"))
    if view["sites"]["items"]:
        links.append(("sites", "Sites"))
    if view["fixes"]["items"] or view["fixes"]["skipped"]:
        links.append(("fixes", "Fixes"))
    return (
        '<nav class="nav">'
        + "".join(f'<a href="#{target}">{_esc(label)}</a>' for target, label in links)
        + "</nav>"
    )


def render_html(view: dict) -> str:
    """One self-contained HTML page for a view from `build_view`."""
    ids = _Ids()
    body = "".join(
        [
            _header(view),
            _nav(view),
            _stats(view),
            _prescription_html(view, ids),
            _timeline_html(view),
            _breakdown_html(view),
            _ranks_html(view),
            _diagnoses_html(view, ids),
            _modules_html(view),
            _sites_html(view),
            _fixes_html(view, ids),
            _notes_html(view),
        ]
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{_esc(view.get('title') or 'oomdoc')}</title>"
        f"<style>{_CSS}</style></head>"
        f'<body><main class="page">{body}'
        "<footer>Written by oomdoc. This file is self-contained: it loads nothing from the network.</footer>"
        f"</main><script>{_JS}</script></body></html>\n"
    )


def render_html_report(document: dict, top: int = 10) -> str:
    """The HTML report of a snapshot document, analysed as `oomdoc suggest` does."""
    from oomdoc.analysis import analyse
    from oomdoc.model import Snapshot

    return HtmlReporter.from_analysis(analyse(Snapshot.from_dict(document), top=top)).render()


class HtmlReporter:
    """One self-contained HTML page (`--format html`, `run --html`,
    `check --html`). The page renders the snapshot's and the analysis's JSON
    forms (docs/snapshot.md, `suggest --format json`): `build_view` is the
    one place that reads them."""

    format = "html"

    def __init__(self, analysis: Analysis):
        self.analysis = analysis

    @classmethod
    def from_analysis(cls, analysis: Analysis, snapshot_path: str | None = None) -> HtmlReporter:
        return cls(analysis)

    def render(self) -> str:
        from oomdoc.reporters.json_report import JsonReporter

        document = self.analysis.snapshot.to_dict()
        return render_html(build_view(document, JsonReporter(self.analysis).as_dict()))


_CSS = """
:root{--bg:#f4f6f9;--card:#fff;--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--bad:#dc2626;
--bad-bg:#fef2f2;--good:#16a34a;--good-bg:#f0fdf4;--warn:#d97706;--accent:#2563eb}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:12.5px}
.page{max-width:1120px;margin:0 auto;padding:28px 24px 48px}
.top .brand{font-weight:700;letter-spacing:.02em;color:var(--accent);font-size:13px;text-transform:uppercase}
.top .brand span{color:var(--muted);font-weight:500;text-transform:none;letter-spacing:0;margin-left:6px}
h1{overflow-wrap:anywhere;font-size:22px;line-height:1.35;margin:8px 0 10px;font-weight:650}
h2{font-size:16px;margin:0 0 4px;font-weight:650}
h3{font-size:14px;margin:18px 0 6px}
.meta{color:var(--muted);font-size:13px;display:grid;gap:2px}
.meta .k{display:inline-block;min-width:72px;color:#94a3b8;font-size:12px;text-transform:uppercase;letter-spacing:.03em}
.meta code{color:var(--ink);background:#eef2f7;padding:1px 6px;border-radius:4px;word-break:break-all}
.callout{margin-top:12px;padding:10px 14px;border-radius:8px;border:1px solid #fecaca;background:var(--bad-bg)}
.callout code{overflow-wrap:anywhere;background:#fff;padding:1px 6px;border-radius:4px;border:1px solid #fecaca}
.callout details{margin-top:4px}.callout summary{cursor:pointer;color:#991b1b;font-size:13px}
.callout pre{white-space:pre-wrap;word-break:break-word;margin:6px 0 0;color:#7f1d1d}
.nav{display:flex;gap:6px;flex-wrap:wrap;margin:18px 0 4px}
.nav a{color:var(--accent);text-decoration:none;background:#e8effd;padding:3px 10px;border-radius:999px;font-size:12.5px}
.nav a:hover{background:#d6e3fb}
.stats{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:12px;margin:14px 0}
.stat{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px}
.stat-label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.03em}
.stat-value{overflow-wrap:anywhere;font-size:20px;font-weight:650;margin-top:2px;font-variant-numeric:tabular-nums}
.stat-sub{color:var(--muted);font-size:12.5px;min-height:1em}
.stat.bad .stat-value{color:var(--bad)}.stat.good .stat-value{color:var(--good)}
.card{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:18px 20px;margin:14px 0;
box-shadow:0 1px 2px rgba(15,23,42,.04)}
.sub{color:var(--muted);margin:0 0 12px;font-size:13px}
.hint{color:var(--muted);font-size:12.5px;margin:8px 0 0}.hint a{color:var(--accent)}
.muted{color:var(--muted)}.small{font-size:12px}.strong{font-weight:650}
.empty{color:var(--muted)}
.badge{display:inline-block;font-size:11.5px;font-weight:600;padding:1px 8px;border-radius:999px;vertical-align:middle;
white-space:nowrap}
.badge-bad{background:#fee2e2;color:#b91c1c}.badge-good{background:#dcfce7;color:#15803d}
.badge-warn{background:#fef3c7;color:#b45309}.badge-neutral{background:#eef2f7;color:#475569}
h1 .badge{font-size:12.5px;padding:3px 10px;position:relative;top:-2px}
.prescription{border-color:#bbf7d0;background:linear-gradient(180deg,#f0fdf4,#fff 60%)}
.lead{font-size:15px;margin:6px 0}.facts{margin:4px 0 10px;padding-left:18px;color:#334155}
.fixcards{display:grid;grid-template-columns:repeat(auto-fit,minmax(240px,1fr));gap:10px;margin-top:10px}
.fixcard{border:1px solid var(--line);border-radius:10px;padding:10px 12px;background:#fafbfc}
.fixcard.fits{border-color:#86efac;background:var(--good-bg)}
.fixcard-name{font-weight:650}.fixcard-sub{color:var(--muted);font-size:12.5px;margin-top:2px}
.chart-wrap{position:relative}
.chart{width:100%;height:auto;display:block}
.chart .grid{stroke:#eef2f7;stroke-width:1}.chart .axis{stroke:#cbd5e1}
.chart .tick{fill:#64748b;font-size:11.5px}.chart .phase-tick{fill:#94a3b8;font-size:11px}.chart .axis-label{fill:#94a3b8;font-size:11.5px}
.chart .stepband{fill:#f8fafc}
.chart .reserved{fill:#dbeafe;opacity:.9}
.chart .allocated{fill:none;stroke:#2563eb;stroke-width:2;stroke-linejoin:round}
.chart .allocated-area{fill:#2563eb;opacity:.07}
.chart .end{fill:none;stroke:#0f172a;stroke-width:1.5;stroke-dasharray:5 4}
.chart .enddot{fill:#fff;stroke:#0f172a;stroke-width:1.3}
.chart .dot{stroke:#fff;stroke-width:1.2}
.chart .capacity{stroke:#dc2626;stroke-width:1.6;stroke-dasharray:7 5}
.chart .capacity-label{fill:#dc2626;font-size:12px;font-weight:600}
.growth{margin:8px 0 0;padding:6px 10px;border-radius:6px;background:#fffbeb;color:#92400e;font-size:13px;
border:1px solid #fde68a}
.oom-marker line{stroke:#dc2626;stroke-width:1.2;stroke-dasharray:3 3}
.oom-marker line.need{stroke-width:3;stroke-dasharray:none;stroke-linecap:round}
.oom-marker circle{fill:#dc2626;stroke:#fff;stroke-width:2}
.oom-marker path{stroke:#fff;stroke-width:2}
.oom-marker text{fill:#b91c1c;font-size:12.5px;font-weight:650}
.peak-marker circle{fill:none;stroke:#2563eb;stroke-width:2}.peak-marker text{fill:#1d4ed8;font-size:12px;font-weight:600}
.hover-line{stroke:#94a3b8;stroke-width:1}
.tooltip{position:absolute;pointer-events:none;background:#0f172a;color:#fff;font-size:12px;padding:6px 9px;border-radius:6px;
white-space:pre;box-shadow:0 4px 12px rgba(0,0,0,.15)}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;color:#475569;font-size:12.5px;margin-top:6px}
.lg{display:inline-flex;align-items:center;gap:6px}
.sw{display:inline-block;width:11px;height:11px;border-radius:3px;vertical-align:-1px;margin-right:6px}
.lg .sw{margin-right:0}
.sw-line{height:3px;width:18px;border-radius:2px}.sw-dash{height:0;width:18px;border-top:2px dashed;border-radius:0;background:none}
.sw-dot{border-radius:50%}
.sw-requested,.seg-requested{background:repeating-linear-gradient(45deg,#dc2626 0 4px,#fca5a5 4px 8px)}
.stack{position:relative;display:flex;height:30px;border-radius:7px;overflow:visible;background:#f1f5f9;margin:12px 0 4px}
.stack .seg{height:100%}.stack .seg:first-child{border-radius:7px 0 0 7px}
.stack.small{height:12px;margin:0;min-width:160px;border-radius:4px}.stack.small .seg:first-child{border-radius:4px 0 0 4px}
.cap-marker{position:absolute;top:-5px;bottom:-5px;width:0;border-left:2px dashed #dc2626}
.stack-scale{display:flex;justify-content:space-between;color:var(--muted);font-size:12px;margin-bottom:10px}
.tbl{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
.tbl th{font-weight:600;color:#475569;font-size:12px;text-transform:uppercase;letter-spacing:.03em;text-align:left;
padding:6px 10px;border-bottom:1px solid var(--line)}
.tbl td{padding:6px 10px;border-bottom:1px solid #f1f5f9}
.tbl .num{text-align:right;white-space:nowrap}
.tbl tr.total td{font-weight:650;border-top:1px solid var(--line)}
.tbl tr.requested td{color:#b91c1c}
.barcell{width:34%}.modules-table .barcell{width:18%}.modname{white-space:nowrap}
.minibar{height:8px;background:#f1f5f9;border-radius:4px;overflow:hidden}.minibar div{height:100%}
.scroll{overflow-x:auto}
.site-head,.site summary{display:grid;grid-template-columns:92px 110px 140px minmax(0,1fr) 190px;gap:12px;align-items:center}
.site-head{color:#475569;font-size:12px;text-transform:uppercase;letter-spacing:.03em;font-weight:600;padding:4px 10px;
border-bottom:1px solid var(--line)}
.site{border-bottom:1px solid #f1f5f9}
.site summary{cursor:pointer;padding:7px 10px;list-style:none}
.site summary::-webkit-details-marker{display:none}
.site summary:hover{background:#f8fafc}
.site[open] summary{background:#f1f5f9}
.site-bytes{text-align:right;font-weight:600;font-variant-numeric:tabular-nums}
.site-bar{height:8px;background:#f1f5f9;border-radius:4px;overflow:hidden}.site-bar i{display:block;height:100%}
.site-loc code{word-break:break-all}.site-tensors{color:var(--muted);font-size:12.5px}
.stack-frames{margin:4px 10px 10px 40px;padding:8px 12px 8px 28px;background:#f8fafc;border-radius:8px;font-size:12.5px}
.stack-frames li{margin:1px 0}
.fixes{display:grid;gap:2px}
.fixrow{display:grid;grid-template-columns:210px minmax(0,1fr) 250px;gap:14px;align-items:center;padding:9px 10px;
border-radius:8px;border-left:3px solid transparent}
.fixrow.fits{background:var(--good-bg);border-left-color:var(--good)}
.fixrow.baseline{background:#fff5f5;border-left-color:var(--bad)}
.fixname{font-weight:650;word-break:break-word}
.fixname .rank{display:inline-block;min-width:20px;color:var(--muted);font-weight:500}
.track{position:relative;height:16px;background:#f1f5f9;border-radius:5px}
.bar{height:100%;border-radius:5px}
.bar-fits{background:#22c55e}.bar-no{background:#cbd5e1}
.bar-lower{background:repeating-linear-gradient(45deg,#f87171 0 5px,#fecaca 5px 10px)}
.bar-need{background:#ef4444}
.bar-estimated{opacity:.6}
.fixnums{font-variant-numeric:tabular-nums;display:flex;flex-wrap:wrap;gap:2px 10px;font-size:13px}
.fixdetail{grid-column:1 / -1;margin:0 0 2px 24px}
.fixdetail summary{cursor:pointer;color:var(--accent);font-size:12.5px}
.fixdetail p{margin:6px 0;color:#334155}
.code{position:relative;margin:8px 0}
.code pre{background:#0f172a;color:#e2e8f0;padding:12px 14px;border-radius:8px;overflow-x:auto;margin:0;line-height:1.45}
.copy{position:absolute;top:8px;right:8px;background:#334155;color:#e2e8f0;border:0;border-radius:6px;padding:3px 10px;
font-size:12px;cursor:pointer}
.copy:hover{background:#475569}.copy.done{background:#16a34a;color:#fff}
.diag{border:1px solid var(--line);border-radius:10px;padding:10px 14px;margin:10px 0}
.diag.bug{border-color:#fecaca;background:#fffafa}
.diag-head{display:flex;align-items:center;gap:8px}
.num-circle{display:inline-flex;width:22px;height:22px;border-radius:50%;background:#eef2f7;color:#475569;font-size:12px;
align-items:center;justify-content:center;font-weight:600}
.diag-summary{margin:6px 0 4px;font-weight:550}
.diag ul{margin:4px 0;padding-left:20px;color:#334155}
.skipped{color:#475569;padding-left:20px}
.ranks-table td,.ranks-table th{text-align:center;vertical-align:middle}
.ranks-table tbody th{text-align:left;text-transform:none;font-size:12.5px;letter-spacing:0;white-space:nowrap}
.rankcol.first{background:var(--bad-bg)}
.rankbar .capline{stroke:#dc2626;stroke-width:1.5;stroke-dasharray:4 3}
.spark polyline{fill:none;stroke:#2563eb;stroke-width:1.5}
.notes ul{margin:4px 0;padding-left:20px;color:#475569}
footer{color:#94a3b8;font-size:12px;text-align:center;margin-top:26px}
@media (max-width:800px){.fixrow{grid-template-columns:1fr}.site-head{display:none}
.site summary{grid-template-columns:80px 1fr}.site-bar,.site-tensors{display:none}}
"""

# Copy buttons, the timeline's hover read-out and the time the page took to
# render. Snapshot strings reach the page only through textContent.
_JS = r"""
(function(){
"use strict";
function formatBytes(n){
  if(typeof n!=="number"||!isFinite(n))return "?";
  var sign=n<0?"-":"";n=Math.abs(n);
  var units=["bytes","KiB","MiB","GiB","TiB"];
  for(var i=0;i<units.length;i++){
    if(n<1024||i===units.length-1){return i===0?sign+Math.floor(n)+" bytes":sign+n.toFixed(2)+" "+units[i];}
    n/=1024;
  }
}
function copyText(text,button){
  function done(){button.textContent="Copied";button.classList.add("done");
    setTimeout(function(){button.textContent="Copy";button.classList.remove("done");},1500);}
  function fallback(){
    var area=document.createElement("textarea");area.value=text;area.setAttribute("readonly","");
    area.style.position="fixed";area.style.opacity="0";document.body.appendChild(area);area.select();
    try{document.execCommand("copy");done();}catch(e){}
    document.body.removeChild(area);
  }
  if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(text).then(done,fallback);}
  else{fallback();}
}
var buttons=document.querySelectorAll("button.copy");
for(var i=0;i<buttons.length;i++){
  buttons[i].addEventListener("click",function(event){
    var target=document.getElementById(event.currentTarget.getAttribute("data-copy"));
    if(target){copyText(target.textContent,event.currentTarget);}
  });
}
var dataNode=document.getElementById("timeline-data");
var svg=document.getElementById("timeline-svg");
if(dataNode&&svg){
  var data=JSON.parse(dataNode.textContent);
  var tooltip=document.getElementById("tooltip");
  var guide=document.getElementById("hover-line");
  var points=data.allocated;
  var ends=data.end;
  var nearest=function(series,x){
    var lo=0,hi=series.length-1;
    if(hi<0)return null;
    while(hi-lo>1){var mid=(lo+hi)>>1;if(series[mid][0]<x)lo=mid;else hi=mid;}
    return Math.abs(series[lo][0]-x)<=Math.abs(series[hi][0]-x)?series[lo]:series[hi];
  };
  svg.addEventListener("mousemove",function(event){
    var box=svg.getBoundingClientRect();
    var vx=(event.clientX-box.left)/box.width*data.width;
    var x=data.xMin+(vx-data.left)/data.plotW*(data.xMax-data.xMin);
    var point=nearest(points,x);
    if(!point){return;}
    var px=data.left+(point[0]-data.xMin)/(data.xMax-data.xMin)*data.plotW;
    guide.setAttribute("x1",px);guide.setAttribute("x2",px);guide.setAttribute("visibility","visible");
    var lines=["step "+point[2]+", "+point[3],"allocated "+formatBytes(point[1])];
    var end=nearest(ends,x);
    if(end&&end[2]===point[2]){lines.push("end of step "+formatBytes(end[1]));}
    var reserved=nearest(data.reserved,x);
    if(reserved&&reserved[2]===point[2]){lines.push("reserved "+formatBytes(reserved[1]));}
    tooltip.textContent=lines.join("\n");
    tooltip.hidden=false;
    var left=px/data.width*box.width+12;
    if(left>box.width-170){left-=190;}
    tooltip.style.left=left+"px";tooltip.style.top=(event.clientY-box.top+12)+"px";
  });
  svg.addEventListener("mouseleave",function(){tooltip.hidden=true;guide.setAttribute("visibility","hidden");});
}
document.body.setAttribute("data-script-ms",performance.now().toFixed(1));
window.addEventListener("load",function(){
  document.body.setAttribute("data-loaded-ms",performance.now().toFixed(1));
  /* Reading a size forces style and layout of the whole page: rendered but for painting. */
  document.body.getBoundingClientRect();
  document.body.setAttribute("data-rendered-ms",performance.now().toFixed(1));
  requestAnimationFrame(function(){document.body.setAttribute("data-painted-ms",performance.now().toFixed(1));});
});
})();
"""
