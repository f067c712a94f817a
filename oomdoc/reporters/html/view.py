"""What the HTML page shows: `build_view(analysis)` reads the typed snapshot
(oomdoc.model) and its analysis once and returns the view, a small JSON-safe
dict (ints, finite floats, strings, lists, dicts, None) that the drawing
modules turn into markup. Every list is capped and every string clipped, so a
snapshot of any size gives a page of bounded size; the strings still come
from the snapshot and are escaped when drawn.

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
- `whole_run_batch`: None, or `batch_size` (the largest batch certified for
  the whole run, None when none was), `setting` (the allocator setting it
  needs, or None), `note` (why).
- `prescription`: None, or `fixes` (names), `batch_size`, `accumulation_steps`,
  `peak_allocated_bytes`, `headroom_bytes`, `fits`, `samples_per_second`,
  `measured`, `snippet` (the document's, else the snippets of its fixes),
  `samples_per_second_noise`, `considered` (lines: the configurations weighed),
  `evaluation_batch_size` and `evaluation_batch_option` (the evaluation batch
  the replays searched and ran with, and the script's option for it),
  `certificate` (lines: what it holds for over the whole run, and the gaps).
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
import math
import os
import shlex
from dataclasses import replace
from typing import Optional

from oomdoc.analysis import Analysis
from oomdoc.diagnosis import Diagnosis
from oomdoc.formatting import relative_path, tensor_description
from oomdoc.model import (
    Breakdown,
    FixResult,
    FlagsCheck,
    Frame,
    Location,
    ModuleUsage,
    Oom,
    Peak,
    Prescription,
    RankEntry,
    Site,
    Snapshot,
)
from oomdoc.reporters.tables import certificate_lines, considered_lines

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


def clip(text: Optional[str], limit: int = MAX_TEXT) -> Optional[str]:
    """`text` cut to `limit` characters (an ellipsis marks the cut)."""
    if text is None:
        return None
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _finite(value: Optional[float]) -> Optional[float]:
    """The view is JSON without NaN or infinity; a record built in this
    process (a replay's ratio) was never through the parser that drops them."""
    return value if value is not None and math.isfinite(value) else None


def _relative(filename: str, cwd: Optional[str]) -> str:
    return relative_path(filename, cwd) if cwd and os.path.isabs(filename) else filename


def _frame_text(frame: Frame, cwd: Optional[str]) -> Optional[str]:
    """`file:line in function`, relative to the run's cwd, or None."""
    filename = clip(frame.file, 300) or clip(frame.filename, 300)
    if not filename:
        return None
    text = _relative(filename, cwd)
    if frame.line is not None:
        text += f":{frame.line}"
    function = clip(frame.function, 120) or clip(frame.name, 120)
    if function:
        text += f" in {function}"
    return text


def _location(location: Optional[Location], cwd: Optional[str]) -> Optional[str]:
    if location is None:
        return None
    return _frame_text(
        Frame(file=location.file, line=location.line, function=location.function), cwd
    )


# ----------------------------------------------------------------- the view


def build_view(analysis: Analysis) -> dict:
    """The report's data, read once from the snapshot and its analysis; see
    the module docstring for the keys."""
    # The view is acyclic; pausing the cycle collector while it is built
    # halves the time on big snapshots.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _build_view(analysis)
    finally:
        if collecting:
            gc.enable()


def _build_view(analysis: Analysis) -> dict:
    snapshot = analysis.snapshot
    device = snapshot.device
    capacity = snapshot.capacity_bytes
    cwd = snapshot.cwd
    fixes = _fix_items(analysis)
    return {
        "title": _title(snapshot.command),
        "headline": clip(analysis.headline) or "",
        "outcome": clip(snapshot.outcome, 40) or "unknown",
        "command": clip(" ".join(shlex.quote(part) for part in snapshot.command)) or "",
        "created_at": clip(snapshot.created_at, 80) or None,
        # "?": the model's default, the document did not say.
        "oomdoc_version": clip(snapshot.oomdoc_version, 80)
        if snapshot.oomdoc_version != "?"
        else None,
        "torch_version": clip(snapshot.torch_version, 80) or None,
        "step_unit": clip(snapshot.step_unit, 40),
        "device": {
            "name": clip(device.name, 200) or "device",
            "kind": clip(device.kind, 40) or None,
            "capacity_bytes": capacity,
        },
        "oom": _oom(snapshot.oom, cwd) if snapshot.outcome == "oom" else None,
        "peak": _peak(snapshot.peak),
        "max_batch_size": snapshot.max_batch_size,
        "whole_run_batch": _whole_run_batch(snapshot),
        "prescription": _prescription(snapshot, capacity),
        "top_fixes": sorted(fixes["items"], key=lambda fix: fix["fits"] is not True)[:3],
        "timeline": _timeline(snapshot, capacity),
        "breakdown": _breakdown(snapshot, capacity),
        "modules": _modules(snapshot.modules) if snapshot.modules else None,
        "sites": _sites(snapshot.top_allocations, cwd),
        "fixes": fixes,
        "diagnoses": _diagnoses(analysis.diagnoses),
        "notes": _notes(snapshot),
        "ranks": _ranks(snapshot, cwd) if snapshot.ranks else None,
    }


def _title(command: list[str]) -> str:
    if command and command[0] == "-m" and len(command) > 1:
        name = command[1]
    elif command:
        name = os.path.basename(command[0])
    else:
        name = "snapshot"
    return clip(f"oomdoc: {name}", 200) or "oomdoc"


def _oom(oom: Optional[Oom], cwd: Optional[str]) -> Optional[dict]:
    if oom is None:
        return None
    return {
        "step": oom.step,
        "phase": clip(oom.phase, 40),
        "requested_bytes": oom.requested_bytes,
        "allocated_bytes": oom.allocated_bytes,
        "need_bytes": oom.needed_bytes,
        "location": _location(oom.location, cwd),
        "message": clip(oom.message) or None,
    }


def _peak(peak: Optional[Peak]) -> Optional[dict]:
    if peak is None:
        return None
    return {
        "allocated_bytes": peak.allocated_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "step": peak.step,
        "phase": clip(peak.phase, 40),
    }


def _prescription(snapshot: Snapshot, capacity: int) -> Optional[dict]:
    prescription: Optional[Prescription] = snapshot.prescription
    if prescription is None:
        return None
    names = [text for text in (clip(name) for name in prescription.fixes[:10]) if text]
    peak = prescription.peak_allocated_bytes
    snippet = clip(prescription.snippet)
    if not snippet:
        parts = []
        for name in names:
            fix = snapshot.fix_named(name)
            fix_snippet = clip(fix.snippet) if fix else None
            if fix_snippet:
                parts.append(f"# {name}\n{fix_snippet}")
        snippet = clip("\n\n".join(parts)) or None
    return {
        "fixes": names,
        "batch_size": prescription.batch_size,
        "accumulation_steps": prescription.accumulation_steps,
        "evaluation_batch_size": prescription.evaluation_batch_size,
        "evaluation_batch_option": clip(prescription.evaluation_batch_option, 80),
        "peak_allocated_bytes": peak,
        "headroom_bytes": capacity - peak if peak is not None and capacity else None,
        "fits": prescription.fits,
        "samples_per_second": _finite(prescription.samples_per_second),
        "throughput_batch_size": prescription.throughput_batch_size,
        "measured": prescription.measured,
        "snippet": snippet,
        "kind": clip(prescription.kind, 20),
        "detail": clip(prescription.detail, 2000),
        "accumulation_measured": prescription.accumulation_measured,
        "verified_by_flags": _flags_replay(prescription.verified_by_flags),
        "samples_per_second_noise": _finite(prescription.samples_per_second_noise),
        # The configurations the search weighed, as the terminal shows them.
        "considered": [clip(line, 400) for line in considered_lines(prescription.considered or [])],
        # What it was measured to hold for over the whole run, as the terminal shows it.
        "certificate": [
            clip(line.strip(), 400) for line in certificate_lines(prescription.certificate)
        ],
    }


def _whole_run_batch(snapshot: Snapshot) -> Optional[dict]:
    """The largest batch's whole-run certificate (oomdoc.replay.largest_batch)."""
    search = snapshot.replay.batch_search if snapshot.replay is not None else None
    if search is None or (search.whole_run_batch_size is None and not search.whole_run_note):
        return None
    return {
        "batch_size": search.whole_run_batch_size,
        "setting": clip(search.whole_run_setting, 200),
        "note": clip(search.whole_run_note, 500),
    }


def _flags_replay(record: Optional[FlagsCheck]) -> Optional[dict]:
    """The prescription replayed with the script's own flags (or None)."""
    if record is None or record.args is None:
        return None
    return {
        "args": " ".join(
            text for text in (clip(arg) for arg in [*record.settings, *record.args][:40]) if text
        ),
        "outcome": clip(record.outcome, 40),
        "peak_allocated_bytes": record.peak_allocated_bytes,
        "note": clip(record.note, 500),
    }


def _fix_status(fix: FixResult) -> str:
    if fix.fits:
        return "fits"
    if fix.outcome == "timeout":
        return "timed out"
    if fix.outcome == "error":
        return "failed"
    if fix.outcome == "grows":
        return "still leaks"
    return "out of memory" if fix.measured else "does not fit"


def _fix_items(analysis: Analysis) -> dict:
    snapshot = analysis.snapshot
    replay = snapshot.replay
    need = (replay.baseline_need_bytes if replay else None) or snapshot.needed_bytes
    # As the text report: estimates for a run that fit would only be noise.
    fixes = analysis.shown_fixes[: analysis.top]
    items = []
    for position, fix in enumerate(fixes[:MAX_FIXES], start=1):
        items.append(
            {
                "name": clip(fix.name, 120),
                "rank": fix.rank if fix.rank is not None else position,
                "measured": fix.measured,
                "peak_allocated_bytes": fix.peak_allocated_bytes,
                "saved_bytes": fix.saved_bytes,
                "fits": fix.fits,
                "status": _fix_status(fix),
                "step_time_ratio": _finite(fix.step_time_ratio),
                "step_time_noise": _finite(fix.step_time_noise),
                "detail": clip(fix.detail) or clip(fix.title),
                "snippet": clip(fix.snippet),
            }
        )
    skipped = [
        {"name": clip(item.name, 120), "reason": clip(item.reason)}
        for item in (replay.skipped if replay else [])[:MAX_SKIPPED]
    ]
    max_batch = snapshot.max_batch_size
    return {
        "measured": analysis.fixes_measured,
        "capacity_bytes": snapshot.device.capacity_bytes,
        "need_bytes": need,
        "need_estimated": bool(replay and replay.baseline_need_estimated),
        "max_batch_size": max_batch if max_batch is not None and max_batch >= 0 else None,
        "skipped": skipped,
        "items": items,
    }


# ---------------------------------------------------------------- timeline


def _x(step: int, phase: Optional[str]) -> float:
    return step + PHASE_OFFSETS.get(phase or "", 0.5)


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


def _timeline(snapshot: Snapshot, capacity: int) -> dict:
    steps = sorted(snapshot.steps, key=lambda step: step.index)
    outcome = snapshot.outcome
    allocated: list[list] = []
    reserved: list[list] = []
    ends: list[list] = []
    last = steps[-1] if steps else None
    for step in steps:
        index = step.index
        phase_peaks = step.phase_peaks
        found = False
        for phase, offset in PHASE_OFFSETS.items():
            value = phase_peaks.get(phase)
            if value is not None:
                allocated.append([index + offset, value, index, phase])
                found = True
        if not found:
            phase = clip(step.peak_phase, 40) or "backward"
            allocated.append([_x(index, phase), step.peak_allocated_bytes, index, phase])
        reserved.append([index + 0.5, step.peak_reserved_bytes, index])
        # The step the run died in has no end: its end bytes are after the unwinding.
        value = step.end_allocated_bytes
        if value is not None and not (outcome != "ok" and step is last):
            ends.append([index + END_OFFSET, value, index])
    oom_view = None
    oom = snapshot.oom
    if outcome == "oom" and oom is not None:
        step_index = oom.step if oom.step is not None else (steps[-1].index if steps else 0)
        phase = clip(oom.phase, 40) or "forward"
        oom_view = {
            "x": _x(step_index, phase),
            "step": step_index,
            "phase": phase,
            "allocated_bytes": oom.allocated_bytes,
            "need_bytes": oom.needed_bytes,
        }
        # Nothing ran after the OOM: a phase listed later in its step is not real.
        allocated = [point for point in allocated if point[0] <= oom_view["x"]]
        if not any(point[0] == oom_view["x"] for point in allocated):
            allocated.append([oom_view["x"], oom.allocated_bytes, step_index, phase])
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


def _categories(breakdown: Optional[Breakdown]) -> list[dict]:
    breakdown = breakdown or Breakdown()
    return [{"name": name, "bytes": bytes_} for name, bytes_ in breakdown.items()]


def _breakdown(snapshot: Snapshot, capacity: int) -> dict:
    categories = _categories(snapshot.breakdown)
    oom = snapshot.oom
    return {
        "label": snapshot.moment_label,
        "at": clip(snapshot.breakdown_at, 40),
        "capacity_bytes": capacity,
        "total_bytes": sum(item["bytes"] for item in categories),
        "requested_bytes": max(0, oom.requested_bytes) if snapshot.is_oom and oom else 0,
        "categories": categories,
    }


def _modules(modules: list[ModuleUsage]) -> dict:
    largest_first = sorted(modules, key=lambda module: -module.bytes.total)
    items = []
    for module in largest_first[:MAX_MODULES]:
        by_category = dict(module.bytes.items())
        items.append(
            {
                "path": clip(module.path, 300),
                "class": clip(module.class_name, 200),
                "blocks": module.blocks,
                "bytes": by_category,
                "total_bytes": sum(by_category.values()),
            }
        )
    return {"items": items, "total": len(modules)}


def _stack(site: Site, cwd: Optional[str]) -> list[str]:
    frames = []
    for frame in (site.stack or site.frames)[:MAX_STACK_FRAMES]:
        text = _frame_text(frame, cwd)
        if text:
            frames.append(text)
    return frames


def _sites(sites: list[Site], cwd: Optional[str]) -> dict:
    items = []
    for site in sites[:MAX_SITES]:
        items.append(
            {
                "bytes": max(0, site.bytes),
                "count": site.count,
                "category": clip(site.category, 40),
                "location": _location(site.location, cwd),
                "module": clip(site.module, 200),
                "tensors": tensor_description(replace(site, dtype=clip(site.dtype, 40))),
                "stack": _stack(site, cwd),
            }
        )
    return {"items": items, "total": len(sites)}


def _diagnoses(diagnoses: list[Diagnosis]) -> list[dict]:
    return [
        {
            "kind": clip(item.kind, 80),
            "summary": clip(item.summary),
            "evidence": [clip(line) for line in item.evidence[:MAX_LIST_TEXT]],
            "bytes": item.bytes,
            "fixes": [clip(name) for name in item.fixes[:10]],
            "remedy": clip(item.remedy),
        }
        for item in diagnoses[:MAX_DIAGNOSES]
    ]


def _notes(snapshot: Snapshot) -> list[str]:
    notes = []
    if snapshot.device.kind == "simulated":
        notes.append(
            "On the simulated device every CPU tensor of the script counts against the capacity."
        )
    notes.extend(clip(note) or "" for note in snapshot.notes[:MAX_NOTES])
    return notes


def _rank(rank: RankEntry, cwd: Optional[str]) -> dict:
    categories = _categories(rank.breakdown)
    steps = sorted(
        ([step.index, step.peak_allocated_bytes] for step in rank.steps),
        key=lambda point: point[0],
    )
    device = rank.device
    return {
        "rank": rank.rank,
        "local_rank": rank.local_rank,
        "host": clip(rank.host, 200),
        "device": {
            "name": clip(device.name, 200) if device else None,
            "kind": clip(device.kind, 40) if device else None,
            "capacity_bytes": device.capacity_bytes if device else None,
        },
        "outcome": clip(rank.outcome, 40),
        "oom": _oom(rank.oom, cwd),
        "breakdown": categories,
        "total_bytes": sum(item["bytes"] for item in categories),
        "peak_allocated_bytes": max((value for _, value in steps), default=None),
        "steps": downsample(steps, MAX_RANK_STEP_POINTS),
    }


def _ranks(snapshot: Snapshot, cwd: Optional[str]) -> dict:
    items = [_rank(rank, cwd) for rank in snapshot.ranks[:MAX_RANKS]]
    items.sort(key=lambda item: (item["rank"] is None, item["rank"] or 0))
    first = snapshot.first_failing_rank
    if first is None:
        first = snapshot.first_oom_rank
    return {
        "world_size": snapshot.world_size if snapshot.world_size is not None else len(items),
        "first_failing_rank": first,
        "items": items,
    }
