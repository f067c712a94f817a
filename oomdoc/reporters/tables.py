"""Rows of the report's tables, shared by the text and Markdown reporters.
Bytes are humanised here, at the edge."""

from __future__ import annotations

from typing import Optional

from oomdoc.analysis import Analysis
from oomdoc.categories import module_columns, shown
from oomdoc.formatting import format_location, percent, tensor_description
from oomdoc.model import Certificate, ConsideredConfiguration, FixResult, Site, Snapshot
from oomdoc.sizes import format_bytes

BREAKDOWN_HEADERS = ["category", "bytes", "% of capacity"]
SITE_HEADERS = ["bytes", "category", "location", "tensors"]
TRACE_HEADERS = ["action", "bytes", "category", "location"]
FIX_HEADERS = ["fix", "peak", "saved", "fits", "step time", "how known"]
MEASURED_FIX_HEADERS = ["rank", "fix", "peak", "saved", "% of need", "fits", "step time"]
MEASURED_FIX_ALIGN = ("right", "left", "right", "right", "right", "left", "right")


def breakdown_title(snapshot: Snapshot) -> str:
    device = snapshot.device
    what = "the simulated device" if device.kind == "simulated" else (device.name or "the GPU")
    moment = {"oom": "at the OOM", "peak": "at the peak", "snapshot": "in the snapshot"}.get(
        snapshot.breakdown_at or "", "at the end"
    )
    return f"What filled {what} ({moment})"


def breakdown_rows(snapshot: Snapshot) -> list[list[str]]:
    capacity = snapshot.device.capacity_bytes
    breakdown = snapshot.breakdown
    held = dict(breakdown.items())
    rows = [
        [category, format_bytes(held[category]), percent(held[category], capacity)]
        for category in shown(held)
    ]
    rows.append(["total", format_bytes(breakdown.total), percent(breakdown.total, capacity)])
    return rows


def site_table(
    sites: list[Site], relative_to: str | None, limit: int = 5
) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the largest sites, with a module column when the
    capture named them: one line of a script that calls a framework's
    training loop is every site's location, its layers are not."""
    shown = sites[:limit]
    with_module = any(site.module for site in shown)
    headers = list(SITE_HEADERS)
    if with_module:
        headers.insert(2, "module")
    rows = []
    for site in shown:
        row = [
            format_bytes(site.bytes),
            site.category,
            format_location(site.location, relative_to),
            tensor_description(site),
        ]
        if with_module:
            row.insert(2, site.module or "(outside modules)")
        rows.append(row)
    return headers, rows


def trace_rows(snapshot: Snapshot) -> list[list[str]]:
    return [
        [
            event.action,
            format_bytes(event.bytes),
            event.category,
            format_location(event.location, snapshot.cwd)
            if event.location
            else "(no Python stack)",
        ]
        for event in snapshot.trace_before_oom or []
    ]


def ratio_text(ratio: object, noise: Optional[float] = None) -> str:
    """A step-time ratio, with its noise when known (1.32x +-4%)."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
        return "-"
    return f"{ratio:.2f}x" + (f" +-{noise:.0%}" if noise else "")


def step_time_text(fix: FixResult) -> str:
    if fix.step_time_flag:
        return "noise?"
    return ratio_text(fix.step_time_ratio, fix.step_time_noise)


def fix_rows(fixes: list[FixResult]) -> list[list[str]]:
    """One row per fix, measured or estimated alike."""
    return [
        [
            fix.name,
            format_bytes(fix.peak_allocated_bytes) if fix.peak_allocated_bytes is not None else "?",
            format_bytes(fix.saved_bytes) if fix.saved_bytes is not None else "?",
            "yes" if fix.fits else "no",
            ratio_text(fix.step_time_ratio),
            "measured" if fix.measured is not False else "estimated",
        ]
        for fix in fixes
    ]


def measured_fix_rows(analysis: Analysis) -> list[list[str]]:
    """Rank, fix, peak, saved (bytes and % of the failing run's need), fits,
    step-time ratio. A fix that ran out of memory shows what it needed then."""
    replay = analysis.snapshot.replay
    need = replay.baseline_need_bytes if replay else None
    rows = []
    for position, fix in enumerate(analysis.shown_fixes, start=1):
        peak = fix.peak_allocated_bytes
        if peak is None:
            peak_text = "-"
        else:
            peak_text = format_bytes(peak) if fix.fits else f"> {format_bytes(peak)}"
        fits_text = (
            "yes"
            if fix.fits
            else {"timeout": "timed out", "error": "failed", "grows": "leaks"}.get(
                fix.outcome or "", "no"
            )
        )
        saved = fix.saved_bytes
        rows.append(
            [
                str(fix.rank if fix.rank is not None else position),
                fix.name,
                peak_text,
                format_bytes(saved) if saved is not None else "-",
                percent(saved, need) if saved is not None and need else "-",
                fits_text,
                step_time_text(fix),
            ]
        )
    return rows


def replay_summary_lines(analysis: Analysis) -> list[str]:
    """What the measured fixes are measured against, the fixes not tried and
    why, and how long the replays took."""
    snapshot = analysis.snapshot
    replay = snapshot.replay
    lines = []
    need = replay.baseline_need_bytes if replay else None
    batch = replay.batch_search.original_batch_size if replay and replay.batch_search else None
    at = f" at batch size {batch}" if batch else ""
    if replay is not None and need:
        capacity = format_bytes(snapshot.device.capacity_bytes)
        if replay.baseline_need_estimated:
            lines.append(
                f"Need of the failing run{at}: {format_bytes(need)} (ESTIMATE from the batch-size model); capacity {capacity}"
            )
        else:
            lines.append(
                f"Need of the failing run{at}: at least {format_bytes(need)} (what it held when it failed); capacity {capacity}"
            )
    maximum = snapshot.max_batch_size
    if maximum is not None and maximum > 0:
        text = (
            f"Largest batch size that fits: {maximum} (measured: {maximum + 1} ran out of memory)"
        )
        prescription = snapshot.prescription
        search = replay.batch_search if replay is not None else None
        if search is not None and search.whole_run_setting and search.whole_run_batch_size:
            # Certified with expandable segments (oomdoc.replay.largest_batch).
            text += (
                f"; for the whole run: {search.whole_run_batch_size} with "
                f"{search.whole_run_setting} (certified; {search.whole_run_note})"
            )
        elif search is not None and search.whole_run_batch_size == maximum:
            text += ", certified for the whole run"
        elif search is not None and search.whole_run_note:
            text += f"; not certified for the whole run: {search.whole_run_note}"
        elif (
            prescription and prescription.certificate and prescription.certificate.allocator_setting
        ):
            # The replays saw the allocator's reservations drift: an edge with no margin.
            text += (
                ", in the replayed steps with the allocator's defaults; later in the run "
                "fragmentation can break it (see the prescription's certificate)"
            )
        lines.append(text)
    if replay is not None and replay.reference_step_s:
        lines.append(f"Step time relative to {replay.reference}")
    for fix in analysis.shown_fixes:
        if fix.step_time_flag:
            lines.append(f"step time of {fix.name}: {fix.step_time_flag}")
    for skipped in replay.skipped if replay else []:
        lines.append(f"not tried: {skipped.name}: {skipped.reason}")
    if replay is not None:
        side_by_side = f", up to {replay.jobs} side by side" if replay.jobs > 1 else ""
        lines.append(
            f"{replay.replays} replays in {replay.total_s:.1f} s{side_by_side} "
            f"(each ran {replay.max_steps or 2} steps with OOMDOC_REPLAY=1)"
        )
    return lines


def first_fix_to_apply(fixes: list[FixResult]) -> FixResult | None:
    """The fix whose snippet an estimate report shows: the first that fits."""
    return next((fix for fix in fixes if fix.fits), fixes[0] if fixes else None)


def fixes_title(measured: bool) -> str:
    if measured:
        return "Fixes, measured by replaying the failing step"
    return "Fixes, estimated from the breakdown (not measured: `oomdoc run` replays measure them)"


def bug_first_notes(analysis: Analysis) -> list[str]:
    bug = analysis.bug_first
    if bug is None:
        return []
    return [f"fix the {bug.kind} above first; these fixes treat the memory it wastes as needed."]


def prescription_lines(analysis: Analysis) -> list[str]:
    """The prescription, first and as one block: what to change, its peak,
    headroom and measured throughput. Plain lines; the reporters frame them."""
    prescription = analysis.snapshot.prescription
    if prescription is None:
        return []
    capacity = analysis.snapshot.device.capacity_bytes
    if prescription.kind == "leak":
        return [
            "Prescription: fix the leak first (no configuration fixes it; every fix below only delays the OOM)",
            f"  {prescription.detail or ''}",
        ]
    changes = ", ".join(prescription.fixes) or "no fix"
    batch = ""
    if prescription.batch_size is not None and prescription.evaluation_batch_flag:
        flag = prescription.evaluation_batch_flag
        batch = f" at evaluation batch size {prescription.batch_size} ({flag} {prescription.batch_size})"
    elif prescription.batch_size is not None:
        batch = f" at batch size {prescription.batch_size}"
        if prescription.accumulation_steps > 1:
            batch += f" x {prescription.accumulation_steps} gradient accumulation steps"
    head = "Prescription (measured)" if prescription.fits else "Closest measured configuration"
    lines = [f"{head}: {changes}{batch}"]
    if prescription.evaluation_batch_size is not None and prescription.evaluation_batch_option:
        search = (
            analysis.snapshot.replay.evaluation_batch_search if analysis.snapshot.replay else None
        )
        was = (
            f": {search.original_batch_size} ran out of memory in the evaluation" if search else ""
        )
        lines.append(
            f"  and the evaluation batch at {prescription.evaluation_batch_size} "
            f"({prescription.evaluation_batch_option} {prescription.evaluation_batch_size}){was}"
        )
    if prescription.peak_allocated_bytes is not None:
        text = (
            f"  peak {format_bytes(prescription.peak_allocated_bytes)} of {format_bytes(capacity)}"
        )
        if prescription.headroom_bytes is not None:
            text += f", headroom {format_bytes(prescription.headroom_bytes)}"
        if prescription.margin_bytes:
            text += (
                f" (keeps the {format_bytes(prescription.margin_bytes)} safety margin free)"
                if prescription.fits
                else (
                    f" (does not keep the {format_bytes(prescription.margin_bytes)} safety margin free)"
                )
            )
        lines.append(text)
    if prescription.accumulation_measured is not None:
        lines.append(
            "  measured with the gradient accumulation running (micro-batches with the gradients alive, optimizer steps)"
            if prescription.accumulation_measured
            else "  the peak is the micro-batch's without gradient accumulation (not measured with it)"
        )
    checked = prescription.verified_by_flags
    if checked is not None and checked.args is not None:
        args = " ".join([*checked.settings, *checked.args])
        peak = checked.peak_allocated_bytes
        if checked.outcome == "fits" and peak is not None:
            verdict = f"fits, peak {format_bytes(peak)}"
            if checked.samples_per_second:
                verdict += f", {checked.samples_per_second:.1f} samples/s"
            if checked.samples_per_second and checked.replay_samples_per_second:
                verdict += (
                    f" (oomdoc's own replay of these changes: "
                    f"{checked.replay_samples_per_second:.1f})"
                )
        else:
            verdict = f"{checked.outcome}" + (
                f", needed more than {format_bytes(peak)}" if peak is not None else ""
            )
        lines.append(f"  replayed with your script's own flags ({args}): {verdict}")
        if checked.note:
            lines.append(f"    ({checked.note})")
        if checked.accumulation_covered is False:
            lines.append("    (it ended before an optimizer step and two more micro-batches)")
    if prescription.samples_per_second:
        # An evaluation batch's prescription is ranked by its training
        # steps' throughput (the evaluation batch does not change it).
        kind = "training throughput" if prescription.evaluation_batch_flag else "throughput"
        text = f"  {kind} {prescription.samples_per_second:.1f} samples/s"
        measured_at = prescription.throughput_batch_size
        if measured_at is not None and measured_at != prescription.batch_size:
            text += f" (measured at batch {measured_at})"
        if prescription.samples_per_second_noise:
            text = text.replace(
                " samples/s", f" samples/s (+-{prescription.samples_per_second_noise:.0%})", 1
            )
        if prescription.throughput_ratio:
            text += f", {prescription.throughput_ratio:.2f}x the failing configuration at its largest fitting batch"
        lines.append(text)
    lines.extend(certificate_lines(prescription.certificate))
    lines.extend(considered_lines(prescription.considered or []))
    return lines


def certificate_lines(certificate: Optional[Certificate]) -> list[str]:
    """What the prescription's replay measured it to hold for over the
    whole run, and each gap (oomdoc.replay.certificate)."""
    if certificate is None:
        return []
    covered = []
    if certificate.shapes == "longest_first" and certificate.longest_input_elements is not None:
        read = (
            f"all {certificate.samples} samples read"
            if certificate.samples_read == certificate.samples
            else f"{certificate.samples_read} of {certificate.samples} samples read"
        )
        covered.append(
            f"longest input {certificate.longest_input_elements} elements "
            f"(sample {certificate.longest_input_sample}; median "
            f"{certificate.median_input_elements}; {read}), longest batch first"
        )
    elif certificate.shapes == "fixed":
        covered.append(f"every input {certificate.longest_input_elements} elements")
    elif certificate.shapes == "fixed_as_seen" and certificate.input_shapes:
        shapes = ", ".join("x".join(map(str, shape)) for shape in certificate.input_shapes)
        covered.append(
            f"batches of one shape ({shapes}) in all {certificate.shape_steps} steps seen "
            "(taken as they came: no sizes to read)"
        )
    if certificate.evaluation_peak_bytes is not None:
        batch = (
            f" at batch {certificate.evaluation_batch_size}"
            if certificate.evaluation_batch_size
            else ""
        )
        covered.append(
            f"evaluation{batch} (peak {format_bytes(certificate.evaluation_peak_bytes)})"
        )
    if certificate.trained_after_evaluation:
        covered.append("a step on the longest batch after it")
    if certificate.optimizer_steps:
        covered.append(f"{certificate.optimizer_steps} optimizer steps")
    covered.append(f"{certificate.ranks} rank" + ("s" if certificate.ranks != 1 else ""))
    head = (
        "certified for the whole run"
        if certificate.certified
        else "not certified for the whole run"
    )
    lines = [f"  {head}: " + ", ".join(covered)]
    lines.append(
        f"    margin {format_bytes(certificate.margin_bytes)}, measured: allocator overhead "
        f"{format_bytes(certificate.allocator_overhead_bytes)}, drift "
        f"{format_bytes(certificate.drift_bytes_per_step)}/step, spread between replays "
        f"{format_bytes(certificate.spread_bytes)} (at least 2% of the capacity)"
    )
    if certificate.allocator_setting:
        lines.append(f"    with {certificate.allocator_setting}")
    lines.extend(f"    not covered: {gap}" for gap in certificate.gaps)
    return lines


VERDICT_WORDS = {
    "prescribed": "prescribed",
    "slower": "slower",
    "over_margin": "over the margin",
    "does_not_fit": "does not fit",
    "not_measured": "not measured",
    "flags_disagree": "not by your flags",
    "slower_by_flags": "slower by your flags",
    "tied_by_flags": "no faster by your flags",
}


def considered_lines(entries: list[ConsideredConfiguration]) -> list[str]:
    """The configurations the search weighed, one line each: at the
    micro-batch each would be prescribed with, its throughput (measured, or
    a bound from a larger batch: "<="), its peak, and the verdict with why."""
    if len(entries) < 2:
        return []
    rows = []
    for entry in entries:
        batch = (
            f"{entry.batch_size} x {entry.accumulation_steps}"
            if entry.batch_size is not None
            else "-"
        )
        speed = "-"
        if entry.samples_per_second:
            speed = ("" if entry.measured else "<= ") + f"{entry.samples_per_second:.1f}/s"
            if entry.samples_per_second_noise:
                speed += f" +-{entry.samples_per_second_noise:.0%}"
        peak = (
            format_bytes(entry.peak_allocated_bytes)
            if entry.peak_allocated_bytes is not None
            else "-"
        )
        verdict = VERDICT_WORDS.get(entry.verdict, entry.verdict)
        reason = f": {entry.reason}" if entry.reason and entry.verdict != "prescribed" else ""
        rows.append((" + ".join(entry.fixes) or "no fix", batch, speed, peak, verdict + reason))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    lines = ["  configurations weighed (micro-batch x accumulation steps, samples/s, peak):"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("    " + "  ".join(cells) + "  " + row[4])
    return lines


def not_enough_alone(fixes: list[FixResult]) -> list[str]:
    """Fixes that did not fit, with what they needed: no snippet."""
    lines = []
    for fix in fixes:
        if fix.fits:
            continue
        need = (
            f"needs more than {format_bytes(fix.peak_allocated_bytes)}"
            if fix.peak_allocated_bytes
            else "did not finish"
        )
        if fix.outcome == "grows":
            need = f"still leaks, peak {format_bytes(fix.peak_allocated_bytes)} so far"
        lines.append(f"{fix.name}: {need} ({fix.detail or fix.outcome or ''})")
    return lines


def module_table(snapshot: Snapshot, limit: int = 8) -> tuple[list[str], list[list[str]]]:
    """The top modules (repeated blocks folded), bytes per category: the
    module table's columns of oomdoc.categories, those not always shown only
    where a module shown has some."""
    modules = snapshot.modules[:limit]
    names = shown(*(dict(module.bytes.items()) for module in modules))
    columns = module_columns(names)
    headers = ["module", "class", "blocks", *(c.module_header for c in columns), "total"]
    rows = []
    for module in modules:
        usage = module.bytes
        rows.append(
            [
                module.path,
                module.class_name if module.class_name != "?" else "",
                str(module.blocks) if module.blocks > 1 else "",
                *(format_bytes(usage.bytes_of(c.name)) for c in columns),
                format_bytes(usage.total),
            ]
        )
    return headers, rows


def modules_lead(snapshot: Snapshot) -> bool:
    """One line of the user's code holds most of the bytes (a framework's
    `trainer.train()`): the modules say more than the lines, so they come first."""
    total = snapshot.breakdown.total
    sites = snapshot.top_allocations
    if not snapshot.modules or not sites or not total:
        return False
    by_line: dict[tuple, int] = {}
    for site in sites:
        key = (site.location.file, site.location.line) if site.location else ()
        by_line[key] = by_line.get(key, 0) + site.bytes
    return max(by_line.values()) >= 0.5 * total


def ranked_fitting(fixes: list[FixResult]) -> list[tuple[int, FixResult]]:
    """(rank, fix) of the fixes that fit: the ones shown with their detail
    and snippet (those that did not fit go to `not_enough_alone`)."""
    return [
        (fix.rank if fix.rank is not None else position, fix)
        for position, fix in enumerate(fixes, start=1)
        if fix.fits
    ]
