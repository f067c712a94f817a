"""`oomdoc check`: a CI gate for memory regressions.

Runs the script for a few steps under the same capture as `oomdoc run`,
compares its peak memory, overall and per category, with a baseline file, and
fails (exit status 1) when something grew beyond the tolerance or the script
ran out of memory. On the simulated device the byte counts are exact and
repeatable, so CPU-only CI runners can gate parameter and activation memory.

What is compared:
- `peak allocated` (and on CUDA `peak reserved`): the device's true peak over
  the steps run, from the backend's counters.
- each category (parameters, gradients, optimizer_state, activations, other):
  the most it held at any phase boundary (end of forward, backward, optimizer
  step) or at the OOM. Categories peak at different moments (activations at
  the end of forward, gradients after backward), so each is gated at its own
  maximum rather than at the one moment the total peaked.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

import oomdoc
from oomdoc import report
from oomdoc.errors import UsageError
from oomdoc.runner import run_child
from oomdoc.session import (
    RunOptions,
    build_snapshot,
    check_device_choice,
    check_target,
    child_request,
    raise_child_usage_error,
)
from oomdoc.sizes import format_bytes
from oomdoc.snapshot import CATEGORIES, SnapshotError, dumps, read_json_file, write_atomic

BASELINE_FORMAT = "oomdoc-baseline"
BASELINE_VERSION = 1
# Allocation sites kept in a baseline, and shown when a check fails.
STORED_SITES = 20
SHOWN_SITES = 5


@dataclass
class CheckOptions:
    run: RunOptions  # target, args, device, capacity and max_steps (the --steps)
    baseline_path: str
    tolerance_fraction: float = 0.05
    tolerance_bytes: int = 0
    tolerance_text: str = "5%"
    update_baseline: bool = False
    junit_path: str | None = None


@dataclass
class Comparison:
    """One compared quantity."""

    name: str
    baseline: int | None  # None: the baseline does not have it
    current: int
    allowed_growth: int

    @property
    def change(self) -> int:
        return self.current - (self.baseline or 0)

    @property
    def grew(self) -> bool:
        """Beyond the tolerance: a regression."""
        return self.baseline is not None and self.change > self.allowed_growth

    @property
    def shrank(self) -> bool:
        """Smaller by more than the tolerance: the baseline could be tightened."""
        return self.baseline is not None and -self.change > self.allowed_growth

    def change_text(self) -> str:
        if self.baseline is None:
            return "(not in baseline)"
        change = self.change
        sign = "+" if change > 0 else ""
        text = f"{sign}{format_bytes(change)}" if change else "0 bytes"
        if self.baseline:
            text += f" ({sign}{100.0 * change / self.baseline:.1f}%)"
        return text

    def status(self) -> str:
        if self.baseline is None:
            return "new"
        return "GREW" if self.grew else ("shrank" if self.shrank else "ok")

    def failure_message(self, tolerance_text: str) -> str:
        return (
            f"{self.name} grew by {self.change_text()}: from {format_bytes(self.baseline)} to "
            f"{format_bytes(self.current)}, more than the {tolerance_text} tolerance allows "
            f"(+{format_bytes(self.allowed_growth)})"
        )


@dataclass
class CheckResult:
    document: dict  # the run's snapshot document
    current: dict  # the run as a baseline
    baseline: dict | None
    comparisons: list[Comparison]
    site_changes: list[dict]
    notes: list[str]
    wall_s: float

    @property
    def measured(self) -> bool:
        return self.document.get("outcome") in ("ok", "oom")

    @property
    def oom(self) -> bool:
        return self.document.get("outcome") == "oom"

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.grew]

    @property
    def failed(self) -> bool:
        return not self.measured or self.oom or bool(self.regressions)


# ------------------------------------------------------------------ baseline


def _relative_location(location: dict | None, cwd: str) -> dict | None:
    """Locations under the working directory are stored relative to it, so a
    baseline made in one checkout matches a check run in another."""
    if not location:
        return None
    filename = report.relative_path(location.get("file", ""), cwd)
    return {
        "file": filename.replace(os.sep, "/"),
        "line": int(location.get("line", 0)),
        "function": location.get("function", "?"),
    }


def measurement(document: dict, steps_requested: int) -> dict:
    """The part of a run's snapshot that a baseline records, in baseline form."""
    cwd = document.get("cwd") or os.getcwd()
    device = document.get("device") or {}
    breakdown = document.get("breakdown") or {}
    category_peaks = document.get("category_peaks") or {}
    peak = document.get("peak") or {}
    sites = []
    for site in (document.get("top_allocations") or [])[:STORED_SITES]:
        sites.append(
            {
                "bytes": int(site.get("bytes", 0)),
                "count": int(site.get("count") or 1),
                "category": site.get("category", "other"),
                "location": _relative_location(site.get("location"), cwd),
                "shape": site.get("shape"),
                "dtype": site.get("dtype"),
            }
        )
    sites.sort(key=lambda s: (-s["bytes"], _site_key(s)))
    return {
        "format": BASELINE_FORMAT,
        "version": BASELINE_VERSION,
        "oomdoc_version": oomdoc.__version__,
        "torch_version": document.get("torch_version", "?"),
        "device": {
            "kind": device.get("kind", "?"),
            "name": device.get("name", "?"),
            "capacity_bytes": int(device.get("capacity_bytes") or 0),
        },
        "command": list(document.get("command") or []),
        "steps": int(steps_requested),
        "steps_run": len(document.get("steps") or []),
        "peak": {
            "allocated_bytes": int(peak.get("allocated_bytes") or 0),
            "reserved_bytes": int(peak.get("reserved_bytes") or 0),
        },
        # The snapshot's breakdown is one sampled moment; the maxima already
        # include it, but a capture without phases has only the breakdown.
        "categories": {
            c: int(max(category_peaks.get(c, 0), breakdown.get(c, 0))) for c in CATEGORIES
        },
        "top_allocations": sites,
    }


def baseline_text(baseline: dict) -> str:
    """Sorted keys, one value per line, no timestamps: a baseline diffs cleanly."""
    return dumps(baseline, sort_keys=True)


def read_baseline(path: str | os.PathLike) -> dict:
    document = read_json_file(path)

    def expect(condition: bool, message: str) -> None:
        if not condition:
            raise SnapshotError(f"{path}: {message}")

    expect(
        isinstance(document, dict) and document.get("format") == BASELINE_FORMAT,
        "not an oomdoc baseline (write one with oomdoc check --update-baseline)",
    )
    expect(
        document.get("version") == BASELINE_VERSION,
        f"unknown baseline version {document.get('version')!r} (this oomdoc reads version {BASELINE_VERSION}; refresh it with --update-baseline)",
    )
    peak = document.get("peak")
    expect(
        isinstance(peak, dict) and _is_byte_count(peak.get("allocated_bytes")),
        "peak.allocated_bytes must be an integer",
    )
    categories = document.get("categories")
    expect(isinstance(categories, dict), "categories must be an object")
    for category in CATEGORIES:
        expect(
            _is_byte_count(categories.get(category)), f"categories.{category} must be an integer"
        )
    expect(isinstance(document.get("device"), dict), "device must be an object")
    sites = document.get("top_allocations", [])
    expect(
        isinstance(sites, list)
        and all(isinstance(s, dict) and _is_byte_count(s.get("bytes")) for s in sites),
        "top_allocations must be a list of objects with integer bytes",
    )
    return document


def _is_byte_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------- comparing


def allowed_growth(baseline_bytes: int, options: CheckOptions) -> int:
    if options.tolerance_bytes:
        return int(options.tolerance_bytes)
    return int(round(options.tolerance_fraction * baseline_bytes))


def compare(baseline: dict, current: dict, options: CheckOptions) -> list[Comparison]:
    quantities = [
        (
            "peak allocated",
            baseline["peak"].get("allocated_bytes"),
            current["peak"]["allocated_bytes"],
        )
    ]
    if "cuda" in (current["device"]["kind"], (baseline.get("device") or {}).get("kind")):
        # On CUDA the cached-but-free memory is what runs out; on the simulated
        # device reserved is allocated.
        quantities.append(
            (
                "peak reserved",
                baseline["peak"].get("reserved_bytes"),
                current["peak"]["reserved_bytes"],
            )
        )
    for category in CATEGORIES:
        quantities.append(
            (category, baseline["categories"].get(category), current["categories"][category])
        )
    return [
        Comparison(
            name=name, baseline=base, current=now, allowed_growth=allowed_growth(base or 0, options)
        )
        for name, base, now in quantities
    ]


def _site_key(site: dict) -> tuple:
    location = site.get("location") or {}
    return (
        site.get("category", "other"),
        location.get("file", ""),
        int(location.get("line", 0)),
        location.get("function", ""),
    )


def site_changes(baseline_sites: list[dict], current_sites: list[dict]) -> list[dict]:
    """Allocation sites (category and line of code) whose bytes at the peak
    differ from the baseline's, largest change first. Shapes are not part of
    the key: a larger batch changes the shape at the same line."""
    totals: dict[tuple, dict] = {}
    for side, sites in (("baseline", baseline_sites), ("current", current_sites)):
        for site in sites:
            entry = totals.setdefault(
                _site_key(site),
                {
                    "category": site.get("category", "other"),
                    "location": site.get("location"),
                    "baseline": 0,
                    "current": 0,
                },
            )
            entry[side] += int(site.get("bytes", 0))
    changes = [
        dict(entry, change=entry["current"] - entry["baseline"]) for entry in totals.values()
    ]
    changes = [entry for entry in changes if entry["change"]]
    changes.sort(key=lambda entry: (-abs(entry["change"]), _site_key(entry)))
    return changes


def mismatch_notes(baseline: dict, current: dict) -> list[str]:
    """Differences in how the two were measured, said plainly."""
    notes = []
    base_device = baseline.get("device") or {}
    device = current["device"]
    if base_device.get("kind") != device["kind"]:
        notes.append(
            f"the baseline was recorded on a {base_device.get('kind')} device ({base_device.get('name')}) and this check ran "
            f"on a {device['kind']} device ({device['name']}): the numbers are not measured the same way"
        )
    elif device["kind"] == "cuda" and base_device.get("capacity_bytes") != device["capacity_bytes"]:
        # (On the simulated device the capacity changes no byte count.)
        notes.append(
            f"the baseline's device had a capacity of {format_bytes(base_device.get('capacity_bytes'))}, this one "
            f"{format_bytes(device['capacity_bytes'])}"
        )
    if baseline.get("torch_version") != current["torch_version"]:
        notes.append(
            f"the baseline was recorded with torch {baseline.get('torch_version')}, this check ran torch {current['torch_version']}"
        )
    if baseline.get("command") != current["command"]:
        notes.append(
            f"the baseline was recorded running `{' '.join(baseline.get('command') or [])}`, this check ran `{' '.join(current['command'])}`"
        )
    if baseline.get("steps_run") != current["steps_run"]:
        notes.append(
            f"the baseline measured {baseline.get('steps_run')} step(s), this check {current['steps_run']}"
        )
    return notes


# ---------------------------------------------------------------- rendering


def comparison_rows(result: CheckResult) -> list[list[str]]:
    return [
        [
            c.name,
            format_bytes(c.baseline) if c.baseline is not None else "-",
            format_bytes(c.current),
            c.change_text(),
            f"+{format_bytes(c.allowed_growth)}",
            c.status(),
        ]
        for c in result.comparisons
    ]


COMPARISON_HEADERS = ["quantity", "baseline", "current", "change", "allowed", "status"]
SITE_HEADERS = ["location", "category", "baseline", "current", "change"]


def site_change_rows(result: CheckResult) -> list[list[str]]:
    rows = []
    for entry in result.site_changes[:SHOWN_SITES]:
        change = entry["change"]
        rows.append(
            [
                report.format_location(entry["location"]),
                entry["category"],
                format_bytes(entry["baseline"]) if entry["baseline"] else "-",
                format_bytes(entry["current"]) if entry["current"] else "-",
                ("+" if change > 0 else "") + format_bytes(change),
            ]
        )
    return rows


def verdict(result: CheckResult, options: CheckOptions) -> str:
    """One line that says how the check ended."""
    document = result.document
    unwritten = " The baseline was not written." if options.update_baseline else ""
    if not result.measured:
        return f"FAIL: nothing was measured. {report.headline(document)}.{unwritten}"
    if result.oom:
        return f"FAIL: the script ran out of memory. {report.headline(document)}.{unwritten}"
    if options.update_baseline:
        return (
            f"baseline written to {options.baseline_path}: peak {format_bytes(result.current['peak']['allocated_bytes'])} "
            f"allocated over {result.current['steps_run']} step(s)"
        )
    regressions = result.regressions
    if regressions:
        names = ", ".join(c.name for c in sorted(regressions, key=lambda c: -c.change))
        return f"FAIL: {names} grew beyond the {options.tolerance_text} tolerance (baseline {options.baseline_path})"
    return (
        f"OK: peak {format_bytes(result.current['peak']['allocated_bytes'])} allocated; every quantity within "
        f"{options.tolerance_text} of the baseline ({options.baseline_path})"
    )


def _blocks(
    result: CheckResult, options: CheckOptions
) -> list[tuple[str, list[str], list[list[str]]]]:
    """The tables of a check report as (title, headers, rows), shared by the
    text and Markdown renderings."""
    blocks = []
    if result.comparisons:
        title = (
            "Peak memory against the baseline"
            if not options.update_baseline
            else "Changes from the previous baseline"
        )
        blocks.append((title, COMPARISON_HEADERS, comparison_rows(result)))
    sites = site_change_rows(result)
    if sites and (result.failed or options.update_baseline):
        blocks.append(
            ("Allocation sites that differ from the baseline (at the peak)", SITE_HEADERS, sites)
        )
    if result.measured and result.baseline is None:
        rows = [["peak allocated", format_bytes(result.current["peak"]["allocated_bytes"])]]
        rows += [[c, format_bytes(result.current["categories"][c])] for c in CATEGORIES]
        blocks.append(("Measured", ["quantity", "bytes"], rows))
    return blocks


def _all_notes(result: CheckResult) -> list[str]:
    notes = list(result.notes)
    shrank = [c.name for c in result.comparisons if c.shrank]
    if shrank and not result.failed:
        notes.append(
            f"{', '.join(shrank)} shrank beyond the tolerance: refresh the baseline with --update-baseline to keep the gain"
        )
    return notes


def render_text(result: CheckResult, options: CheckOptions) -> str:
    lines = ["", f"oomdoc check: {verdict(result, options)}"]
    for title, headers, rows in _blocks(result, options):
        lines += ["", title, tabulate(rows, headers=headers, disable_numparse=True)]
    for note in _all_notes(result):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def render_markdown(result: CheckResult, options: CheckOptions) -> str:
    command = " ".join(result.current.get("command") or [options.run.target])
    lines = [f"### oomdoc check: `{command}`", "", f"**{verdict(result, options)}**"]
    for title, headers, rows in _blocks(result, options):
        lines += [
            "",
            f"#### {title}",
            tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True),
        ]
    for note in _all_notes(result):
        lines += ["", f"> {note}"]
    return "\n".join(lines) + "\n\n"


def junit_xml(result: CheckResult, options: CheckOptions) -> str:
    """One test case for the run itself and one per compared quantity."""
    suite_name = f"oomdoc check {Path(options.run.target).name}"
    classname = "oomdoc.check." + Path(options.run.target).stem
    cases = []
    run_failure = None
    if not result.measured or result.oom:
        run_failure = verdict(result, options)
    cases.append(("run", run_failure, report.headline(result.document)))
    for comparison in result.comparisons:
        failure = (
            comparison.failure_message(options.tolerance_text)
            if comparison.grew and not options.update_baseline
            else None
        )
        detail = (
            f"baseline {comparison.baseline} bytes, current {comparison.current} bytes, "
            f"change {comparison.change} bytes, allowed growth {comparison.allowed_growth} bytes"
        )
        cases.append((comparison.name, failure, detail))
    failures = sum(1 for _name, failure, _detail in cases if failure)
    suite = ElementTree.Element(
        "testsuite",
        {
            "name": suite_name,
            "tests": str(len(cases)),
            "failures": str(failures),
            "errors": "0",
            "skipped": "0",
            "time": f"{result.wall_s:.3f}",
        },
    )
    properties = ElementTree.SubElement(suite, "properties")
    for name, value in (
        ("baseline", options.baseline_path),
        ("tolerance", options.tolerance_text),
        ("device", result.current["device"]["kind"]),
        ("torch_version", result.current["torch_version"]),
    ):
        ElementTree.SubElement(properties, "property", {"name": name, "value": str(value)})
    for name, failure, detail in cases:
        case = ElementTree.SubElement(
            suite, "testcase", {"classname": classname, "name": name, "time": "0"}
        )
        if failure:
            element = ElementTree.SubElement(
                case, "failure", {"message": failure, "type": "oomdoc.MemoryRegression"}
            )
            element.text = detail
        else:
            ElementTree.SubElement(case, "system-out").text = detail
    root = ElementTree.Element(
        "testsuites", {"tests": suite.get("tests"), "failures": suite.get("failures")}
    )
    root.append(suite)
    ElementTree.indent(root)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ElementTree.tostring(root, encoding="unicode")
        + "\n"
    )


# ---------------------------------------------------------------------- run


def measure(options: CheckOptions) -> tuple[dict, float]:
    """Run the script for --steps steps under capture; its snapshot document."""
    run_options = options.run
    check_target(run_options)
    check_device_choice(run_options.device)
    extra_env = {}
    if "PYTHONHASHSEED" not in os.environ:
        # Set iteration order can change the order of allocations and frees;
        # a fixed seed makes two checks of the same code count the same bytes.
        extra_env["PYTHONHASHSEED"] = "0"
    # The child resolves `--device auto` itself: the parent never imports torch.
    result = run_child(child_request(run_options, run_options.device, extra_env=extra_env))
    raise_child_usage_error(result)
    return build_snapshot(run_options, result.capture, result.exit_code), result.wall_s


def evaluate(
    document: dict, baseline: dict | None, options: CheckOptions, wall_s: float = 0.0
) -> CheckResult:
    current = measurement(document, options.run.max_steps or 0)
    measured = document.get("outcome") in ("ok", "oom")
    comparisons, changes, notes = [], [], []
    if baseline is not None and measured:
        comparisons = compare(baseline, current, options)
        changes = site_changes(baseline.get("top_allocations") or [], current["top_allocations"])
        notes = mismatch_notes(baseline, current)
    if measured and document.get("device", {}).get("kind") == "simulated":
        notes.append(
            "on the simulated device every CPU tensor of the script counts, its dataset in memory included."
        )
    if (
        measured
        and document.get("device", {}).get("kind") == "cuda"
        and current["peak"]["allocated_bytes"] == 0
    ):
        # A gate that measures nothing would pass forever: say so.
        notes.append(
            "the script allocated nothing on the GPU: does it move its model and data to CUDA?"
        )
    return CheckResult(
        document=document,
        current=current,
        baseline=baseline,
        comparisons=comparisons,
        site_changes=changes,
        notes=notes,
        wall_s=wall_s,
    )


def run_check(options: CheckOptions, stderr=None) -> int:
    stderr = stderr or sys.stderr
    baseline_path = Path(options.baseline_path)
    baseline, unreadable = None, None
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
    if options.junit_path and Path(options.junit_path).is_dir():
        raise UsageError(f"--junit {options.junit_path}: is a directory")

    document, wall_s = measure(options)
    result = evaluate(document, baseline, options, wall_s)
    if unreadable:
        result.notes.insert(0, unreadable)
    if options.update_baseline and result.measured and not result.oom:
        write_atomic(baseline_path, baseline_text(result.current), overwrite=True)

    print(render_text(result, options), file=stderr, end="")
    if options.junit_path:
        write_atomic(options.junit_path, junit_xml(result, options), overwrite=True)
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path:
        with open(summary_path, "a", encoding="utf-8") as handle:
            handle.write(render_markdown(result, options))

    if document.get("outcome") == "interrupted":
        return 130
    if options.update_baseline:
        return 0 if result.measured and not result.oom else 1
    return 1 if result.failed else 0
