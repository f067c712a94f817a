"""Reporters of `oomdoc check`: the terminal verdict, the GitHub job
summary (Markdown) and JUnit XML. Each renders a CheckResult."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

from tabulate import tabulate

from oomdoc.categories import shown
from oomdoc.check_records import CheckOptions, CheckResult
from oomdoc.formatting import format_location, printable
from oomdoc.reporters.tables import certificate_lines
from oomdoc.sizes import format_bytes

# Allocation sites shown when a check fails.
SHOWN_SITES = 5


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
        change = entry.change
        rows.append(
            [
                format_location(entry.location),
                entry.category,
                format_bytes(entry.baseline) if entry.baseline else "-",
                format_bytes(entry.current) if entry.current else "-",
                ("+" if change > 0 else "") + format_bytes(change),
            ]
        )
    return rows


def verdict(result: CheckResult, options: CheckOptions) -> str:
    """One line that says how the check ended."""
    unwritten = " The baseline was not written." if options.update_baseline else ""
    if not result.measured:
        return f"FAIL: nothing was measured. {result.headline}.{unwritten}"
    if result.oom:
        return f"FAIL: the script ran out of memory. {result.headline}.{unwritten}"
    if options.update_baseline:
        return (
            f"baseline written to {options.baseline_path}: peak {format_bytes(result.current.peak.allocated_bytes)} "
            f"allocated over {result.current.steps_run} step(s)"
        )
    regressions = result.regressions
    if regressions:
        names = ", ".join(c.name for c in sorted(regressions, key=lambda c: -c.change))
        return f"FAIL: {names} grew beyond the {options.tolerance_text} tolerance (baseline {options.baseline_path})"
    if result.uncovered:
        return "FAIL: --whole-run: the run's worst case is not all covered (see below)"
    return (
        f"OK: peak {format_bytes(result.current.peak.allocated_bytes)} allocated; every quantity within "
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
        rows = [["peak allocated", format_bytes(result.current.peak.allocated_bytes)]]
        categories = dict(result.current.categories.items())
        rows += [[c, format_bytes(categories[c])] for c in shown(categories)]
        blocks.append(("Measured", ["quantity", "bytes"], rows))
    return blocks


def _all_notes(result: CheckResult) -> list[str]:
    notes = list(result.notes)
    shrank = [c.name for c in result.comparisons if c.shrank]
    if shrank and not result.failed:
        notes.append(
            f"{', '.join(shrank)} shrank beyond the tolerance: refresh the baseline with --update-baseline to keep the gain"
        )
    new = [c.name for c in result.comparisons if c.baseline is None and c.current]
    if new:
        notes.append(
            f"{', '.join(new)}: not in the baseline (an older oomdoc wrote it), so not gated: "
            "refresh the baseline with --update-baseline to gate it"
        )
    return notes


def whole_run_lines(result: CheckResult) -> list[str]:
    """--whole-run: what the run covered, and each gap."""
    if result.certificate is None:
        return []
    return ["", "The whole run (--whole-run)"] + [
        line[2:] for line in certificate_lines(result.certificate)
    ]


def render_text(result: CheckResult, options: CheckOptions) -> str:
    lines = ["", f"oomdoc check: {verdict(result, options)}"]
    for title, headers, rows in _blocks(result, options):
        lines += ["", title, tabulate(rows, headers=headers, disable_numparse=True)]
    lines += whole_run_lines(result)
    for note in _all_notes(result):
        lines.append(f"note: {note}")
    return printable("\n".join(lines) + "\n")


def render_markdown(result: CheckResult, options: CheckOptions) -> str:
    command = " ".join(result.current.command or [options.run.target])
    lines = [f"### oomdoc check: `{command}`", "", f"**{verdict(result, options)}**"]
    for title, headers, rows in _blocks(result, options):
        lines += [
            "",
            f"#### {title}",
            tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True),
        ]
    whole_run = whole_run_lines(result)
    if whole_run:
        lines += ["", f"#### {whole_run[1]}", "```", *whole_run[2:], "```"]
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
    cases.append(("run", run_failure, result.headline))
    if result.certificate is not None:
        gaps = "; ".join(result.certificate.gaps)
        cases.append(
            (
                "whole run",
                f"not covered: {gaps}" if result.uncovered else None,
                "\n".join(line.strip() for line in certificate_lines(result.certificate)),
            )
        )
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
        ("device", result.current.device.kind),
        ("torch_version", result.current.torch_version),
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
    root = ElementTree.Element("testsuites", {"tests": str(len(cases)), "failures": str(failures)})
    root.append(suite)
    ElementTree.indent(root)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ElementTree.tostring(root, encoding="unicode")
        + "\n"
    )


class CheckTextReporter:
    """The verdict and tables `oomdoc check` prints on stderr."""

    format = "check-text"
    renders = "check"
    summary = "the verdict and tables on stderr"

    def __init__(self, result: CheckResult):
        self.result = result

    @classmethod
    def from_analysis(cls, result: CheckResult) -> CheckTextReporter:
        return cls(result)

    def render(self) -> str:
        assert self.result.options is not None
        return render_text(self.result, self.result.options)


class GithubSummaryReporter(CheckTextReporter):
    """Markdown for $GITHUB_STEP_SUMMARY."""

    format = "github-summary"
    summary = "Markdown for $GITHUB_STEP_SUMMARY"

    def render(self) -> str:
        assert self.result.options is not None
        return render_markdown(self.result, self.result.options)


class JunitReporter(CheckTextReporter):
    """JUnit XML: a test case for the run and one per compared quantity."""

    format = "junit"
    summary = "JUnit XML"

    def render(self) -> str:
        assert self.result.options is not None
        return junit_xml(self.result, self.result.options)
