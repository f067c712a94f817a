"""`oomdoc check`: a CI gate for memory regressions.

Runs the script for a few steps under the same capture as `oomdoc run`,
compares its peak memory, overall and per category, with a baseline file, and
fails (exit status 1) when something grew beyond the tolerance or the script
ran out of memory. On the simulated device the byte counts are exact and
repeatable, so CPU-only CI runners can gate parameter and activation memory.

What is compared:
- `peak allocated` (and on CUDA `peak reserved`): the device's true peak over
  the steps run, from the backend's counters.
- each category (oomdoc.categories; communication only where a run has
  some, and not compared with a baseline written before it existed): the
  most it held at any phase boundary (end of forward, backward, optimizer
  step) or at the OOM. Categories peak at different moments (activations at
  the end of forward, gradients after backward), so each is gated at its own
  maximum rather than at the one moment the total peaked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import oomdoc
from oomdoc.analysis import analyse
from oomdoc.categories import shown
from oomdoc.check_records import (
    Baseline,
    BaselineDevice,
    BaselinePeak,
    CheckOptions,
    CheckResult,
    Comparison,
    SiteChange,
    read_baseline,
    site_key,
)
from oomdoc.errors import UsageError
from oomdoc.formatting import relative_path
from oomdoc.model import CATEGORIES, Breakdown, Location, Site, Snapshot, parse
from oomdoc.output_paths import check_output_file, write_new_file
from oomdoc.records import was_absent
from oomdoc.replay.certificate import certificate_for
from oomdoc.reporters import render
from oomdoc.runner import (
    RunOptions,
    build_snapshot,
    check_device_choice,
    check_target,
    child_request,
    raise_child_usage_error,
    run_child,
)
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import SnapshotError, write_atomic

# Allocation sites kept in a baseline.
STORED_SITES = 20


# ------------------------------------------------------------------ baseline


def _relative_location(location: Location | None, cwd: str) -> Location | None:
    """Locations under the working directory are stored relative to it, so a
    baseline made in one checkout matches a check run in another."""
    if location is None:
        return None
    filename = relative_path(location.file, cwd)
    return Location(
        file=filename.replace(os.sep, "/"), line=location.line, function=location.function
    )


def measurement(snapshot: Snapshot, steps_requested: int) -> Baseline:
    """The part of a run's snapshot that a baseline records."""
    cwd = snapshot.cwd or os.getcwd()
    device = snapshot.device
    category_peaks = snapshot.category_peaks
    peak = snapshot.peak
    sites = [
        Site(
            bytes=site.bytes,
            count=site.count or 1,
            category=site.category,
            location=_relative_location(site.location, cwd),
            shape=site.shape,
            dtype=site.dtype,
        )
        for site in snapshot.top_allocations[:STORED_SITES]
    ]
    sites.sort(key=lambda site: (-site.bytes, site_key(site)))

    # The snapshot's breakdown is one sampled moment; the maxima already
    # include it, but a capture without phases has only the breakdown.
    def most_of(category: str) -> int:
        held_at_peaks = category_peaks.bytes_of(category) if category_peaks else 0
        return max(held_at_peaks, snapshot.breakdown.bytes_of(category))

    return Baseline(
        oomdoc_version=oomdoc.__version__,
        torch_version=snapshot.torch_version,
        device=BaselineDevice(
            kind=device.kind, name=device.name, capacity_bytes=device.capacity_bytes
        ),
        command=list(snapshot.command),
        steps=int(steps_requested),
        steps_run=snapshot.step_count,
        peak=BaselinePeak(
            allocated_bytes=(peak.allocated_bytes if peak else None) or 0,
            reserved_bytes=(peak.reserved_bytes if peak else None) or 0,
        ),
        categories=parse(Breakdown, {category: most_of(category) for category in CATEGORIES}),
        top_allocations=sites,
    )


# ---------------------------------------------------------------- comparing


def allowed_growth(baseline_bytes: int, options: CheckOptions) -> int:
    if options.tolerance_bytes:
        return int(options.tolerance_bytes)
    return int(round(options.tolerance_fraction * baseline_bytes))


def compare(baseline: Baseline, current: Baseline, options: CheckOptions) -> list[Comparison]:
    quantities: list[tuple[str, int | None, int]] = [
        ("peak allocated", baseline.peak.allocated_bytes, current.peak.allocated_bytes)
    ]
    if "cuda" in (current.device.kind, baseline.device.kind):
        # On CUDA the cached-but-free memory is what runs out; on the simulated
        # device reserved is allocated.
        quantities.append(
            ("peak reserved", baseline.peak.reserved_bytes, current.peak.reserved_bytes or 0)
        )
    for category in shown(dict(baseline.categories.items()), dict(current.categories.items())):
        # A category added since the baseline was written is not in it: its
        # bytes moved out of another category, which is no regression.
        recorded = not was_absent(baseline.categories, category)
        quantities.append(
            (
                category,
                baseline.categories.bytes_of(category) if recorded else None,
                current.categories.bytes_of(category),
            )
        )
    return [
        Comparison(
            name=name, baseline=base, current=now, allowed_growth=allowed_growth(base or 0, options)
        )
        for name, base, now in quantities
    ]


def site_changes(baseline_sites: list[Site], current_sites: list[Site]) -> list[SiteChange]:
    """Allocation sites (category and line of code) whose bytes at the peak
    differ from the baseline's, largest change first. Shapes are not part of
    the key: a larger batch changes the shape at the same line."""
    totals: dict[tuple, SiteChange] = {}
    for site in baseline_sites:
        totals.setdefault(
            site_key(site), SiteChange(site.category, site.location)
        ).baseline += site.bytes
    for site in current_sites:
        totals.setdefault(
            site_key(site), SiteChange(site.category, site.location)
        ).current += site.bytes
    changes = [change for change in totals.values() if change.change]
    changes.sort(key=lambda change: (-abs(change.change), change.key))
    return changes


def script_of(command: list) -> str | None:
    """The script's file name (or `-m module`) a recorded command ran. Only
    the name: the same script in another checkout (a CI workspace, a path
    given another way) is the same script."""
    if not command:
        return None
    if command[0] == "-m":
        return f"-m {command[1]}" if len(command) > 1 else None
    return os.path.basename(str(command[0]).replace("\\", "/").rstrip("/"))


def refuse_another_scripts_baseline(baseline: Baseline, run: RunOptions, path: Path) -> None:
    """A baseline recorded for another script measures other code: comparing
    with it would pass or fail at random. Other arguments are only noted."""
    recorded = script_of(baseline.command)
    current = script_of(run.command)
    if recorded is not None and current is not None and recorded != current:
        raise UsageError(
            f"--baseline {path}: recorded for {recorded}, not {current} "
            "(give that script's baseline, or write one for this script with --update-baseline)"
        )


def mismatch_notes(baseline: Baseline, current: Baseline) -> list[str]:
    """Differences in how the two were measured, said plainly."""
    notes = []
    base_device = baseline.device
    device = current.device
    if base_device.kind != device.kind:
        notes.append(
            f"the baseline was recorded on a {base_device.kind} device ({base_device.name}) and this check ran "
            f"on a {device.kind} device ({device.name}): the numbers are not measured the same way"
        )
    elif device.kind == "cuda" and base_device.capacity_bytes != device.capacity_bytes:
        # (On the simulated device the capacity changes no byte count.)
        notes.append(
            f"the baseline's device had a capacity of {format_bytes(base_device.capacity_bytes)}, this one "
            f"{format_bytes(device.capacity_bytes)}"
        )
    if baseline.torch_version != current.torch_version:
        notes.append(
            f"the baseline was recorded with torch {baseline.torch_version}, this check ran torch {current.torch_version}"
        )
    if baseline.command != current.command:
        notes.append(
            f"the baseline was recorded running `{' '.join(baseline.command)}`, this check ran `{' '.join(current.command)}`"
        )
    if baseline.steps_run != current.steps_run:
        notes.append(
            f"the baseline measured {baseline.steps_run} step(s), this check {current.steps_run}"
        )
    return notes


# ---------------------------------------------------------------------- run


def measure(options: CheckOptions) -> tuple[Snapshot, float]:
    """Run the script for --steps steps under capture; its snapshot."""
    run_options = options.run
    check_target(run_options)
    check_device_choice(run_options.device)
    extra_env = {}
    if "PYTHONHASHSEED" not in os.environ:
        # Set iteration order can change the order of allocations and frees;
        # a fixed seed makes two checks of the same code count the same bytes.
        extra_env["PYTHONHASHSEED"] = "0"
    # The child resolves `--device auto` itself: the parent never imports torch.
    result = run_child(
        child_request(
            run_options,
            extra_env=extra_env,
            serial_dataloaders=True,
            whole_run=options.whole_run,
        )
    )
    raise_child_usage_error(result)
    return build_snapshot(run_options, result), result.wall_s


def evaluate(
    snapshot: Snapshot, baseline: Baseline | None, options: CheckOptions, wall_s: float = 0.0
) -> CheckResult:
    current = measurement(snapshot, options.run.max_steps or 0)
    measured = snapshot.outcome in ("ok", "oom")
    comparisons: list[Comparison] = []
    changes: list[SiteChange] = []
    notes: list[str] = []
    if baseline is not None and measured:
        comparisons = compare(baseline, current, options)
        changes = site_changes(baseline.top_allocations, current.top_allocations)
        notes = mismatch_notes(baseline, current)
    if measured and snapshot.dataloader_workers_removed:
        notes.append(
            f"{len(snapshot.dataloader_workers_removed)} DataLoader(s) with worker processes "
            f"(num_workers={max(snapshot.dataloader_workers_removed)}) loaded in the script's process instead, "
            "so that every check counts the same batches"
        )
    if measured and snapshot.device.kind == "simulated":
        notes.append(
            "on the simulated device every CPU tensor of the script counts, its dataset in memory included."
        )
    if measured and snapshot.device.kind == "cuda" and current.peak.allocated_bytes == 0:
        # A gate that measures nothing would pass forever: say so.
        notes.append(
            "the script allocated nothing on the GPU: does it move its model and data to CUDA?"
        )
    certificate = None
    if options.whole_run and measured:
        certificate = certificate_for(
            snapshot, snapshot, snapshot.capacity_bytes, part_of_the_run=False
        )
    return CheckResult(
        certificate=certificate,
        snapshot=snapshot,
        current=current,
        baseline=baseline,
        comparisons=comparisons,
        site_changes=changes,
        notes=notes,
        wall_s=wall_s,
        options=options,
    )


def run_check(options: CheckOptions, stderr: TextIO | None = None) -> int:

    stderr = stderr or sys.stderr
    baseline_path = Path(options.baseline_path)
    baseline: Baseline | None = None
    unreadable = None
    if not baseline_path.exists() and not options.update_baseline:
        raise UsageError(
            f"--baseline {baseline_path}: no such file (create it with --update-baseline)"
        )
    if baseline_path.exists():
        try:
            baseline = read_baseline(baseline_path)
        except SnapshotError as exc:
            if not options.update_baseline:
                raise
            unreadable = f"the previous baseline could not be read and is replaced ({exc})"
    if baseline is not None and not options.update_baseline:
        refuse_another_scripts_baseline(baseline, options.run, baseline_path)
    if options.update_baseline:
        check_output_file(baseline_path, "--baseline", replace=True, create_parents=True)

    snapshot, wall_s = measure(options)
    result = evaluate(snapshot, baseline, options, wall_s)
    if unreadable:
        result.notes.insert(0, unreadable)
    if options.update_baseline and result.measured and not result.oom:
        write_atomic(baseline_path, result.current.text(), overwrite=True)

    print(render("check-text", result), file=stderr, end="")
    if options.junit_path:
        write_atomic(options.junit_path, render("junit", result), overwrite=True)
    if options.html_path:
        write_new_file(options.html_path, render("html", analyse(snapshot)))
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path:
        with open(summary_path, "a", encoding="utf-8") as handle:
            handle.write(render("github-summary", result))

    if snapshot.outcome == "interrupted":
        return 130
    if options.update_baseline:
        return 0 if result.measured and not result.oom else 1
    return 1 if result.failed else 0
