"""The terminal report: what `oomdoc run` prints on stderr and `oomdoc
suggest` on stdout."""

from __future__ import annotations

from tabulate import tabulate

from oomdoc.analysis import Analysis
from oomdoc.formatting import format_location, printable
from oomdoc.reporters import tables
from oomdoc.reporters.ranks import rank_section_lines


class TextReporter:
    format = "text"
    renders = "snapshot"
    summary = "the default"

    def __init__(self, analysis: Analysis, snapshot_path: str | None = None):
        self.analysis = analysis
        self.snapshot_path = snapshot_path

    @classmethod
    def from_analysis(cls, analysis: Analysis, snapshot_path: str | None = None) -> TextReporter:
        return cls(analysis, snapshot_path)

    def render(self) -> str:
        analysis = self.analysis
        snapshot = analysis.snapshot
        lines = ["", f"oomdoc: {analysis.headline}"]
        if analysis.measured_nothing:
            return self._short(lines)
        if snapshot.is_oom and snapshot.oom and snapshot.oom.location:
            lines.append(f"  at {format_location(snapshot.oom.location, snapshot.cwd)}")
        prescription = tables.prescription_lines(analysis)
        if prescription:
            lines += ["", *prescription]
            snippet = snapshot.prescription.snippet if snapshot.prescription else None
            if snippet:
                lines.extend(f"    {line}" for line in snippet.splitlines())
        lines.append("")
        lines.append(tables.breakdown_title(snapshot))
        lines.append(
            tabulate(
                tables.breakdown_rows(snapshot),
                headers=tables.BREAKDOWN_HEADERS,
                colalign=("left", "right", "right"),
            )
        )
        if snapshot.ranks:
            lines += rank_section_lines(snapshot)
        modules = self._module_lines()
        lead = tables.modules_lead(snapshot)
        if lead:
            lines += modules
        headers, sites = tables.site_table(snapshot.top_allocations, snapshot.cwd, analysis.top)
        if sites:
            lines += ["", f"Top {len(sites)} allocation sites"]
            colalign = ("right",) + ("left",) * (len(headers) - 1)
            lines.append(tabulate(sites, headers=headers, colalign=colalign))
        if not lead:
            lines += modules
        trace = tables.trace_rows(snapshot)
        if trace:
            lines += ["", "Allocator events just before the OOM (oldest first)"]
            lines.append(
                tabulate(
                    trace, headers=tables.TRACE_HEADERS, colalign=("left", "right", "left", "left")
                )
            )
        lines.extend(self._diagnosis_lines())
        lines.extend(self._fix_lines())
        lines.extend(f"note: {note}" for note in analysis.notes)
        if self.snapshot_path:
            lines += ["", f"Snapshot: {self.snapshot_path}"]
            torch_snapshot = snapshot.artifacts.get("torch_snapshot_file")
            if torch_snapshot:
                lines.append(
                    f"PyTorch memory snapshot (drag into https://pytorch.org/memory_viz): {torch_snapshot}"
                )
        return printable("\n".join(lines) + "\n")

    def _short(self, lines: list[str]) -> str:
        """A run that put nothing on the device: the headline, the notes, no tables."""
        lines.append(
            "nothing was on the device when the script stopped: its own output above says why"
        )
        lines.extend(f"note: {note}" for note in self.analysis.snapshot.notes)
        if self.snapshot_path:
            lines += ["", f"Snapshot: {self.snapshot_path}"]
        return printable("\n".join(lines) + "\n")

    def _module_lines(self) -> list[str]:
        headers, rows = tables.module_table(self.analysis.snapshot)
        if not rows:
            return []
        moment = self.analysis.snapshot.moment_label
        return [
            "",
            f"Top {len(rows)} modules {moment} (repeated blocks folded)",
            tabulate(
                rows,
                headers=headers,
                colalign=("left", "left", *("right",) * (len(headers) - 2)),
            ),
        ]

    def _diagnosis_lines(self) -> list[str]:
        diagnoses = self.analysis.diagnoses
        if not diagnoses:
            return []
        lines = ["", "Diagnosis (most important first)"]
        for number, item in enumerate(diagnoses, 1):
            lines.append(f"{number}. {item.kind}: {item.summary}")
            lines.extend(f"     - {line}" for line in item.evidence)
            if item.remedy:
                lines.append("     fix:")
                lines.extend(f"       {code}" for code in item.remedy.splitlines())
            elif item.fixes:
                lines.append(f"     fixes: {', '.join(item.fixes)}")
        return lines

    def _fix_lines(self) -> list[str]:
        analysis = self.analysis
        fixes = analysis.shown_fixes
        if not fixes:
            return []
        lines = ["", tables.fixes_title(analysis.fixes_measured)]
        lines.extend(f"note: {note}" for note in tables.bug_first_notes(analysis))
        if analysis.fixes_measured:
            lines.append(
                tabulate(
                    tables.measured_fix_rows(analysis),
                    headers=tables.MEASURED_FIX_HEADERS,
                    tablefmt="simple",
                    colalign=tables.MEASURED_FIX_ALIGN,
                )
            )
            lines.extend(tables.replay_summary_lines(analysis))
            for rank, fix in tables.ranked_fitting(fixes):
                lines += ["", f"{rank}. {fix.name}: {fix.detail or fix.title or ''}"]
                if fix.snippet:
                    lines.extend("    " + line for line in fix.snippet.splitlines())
            alone = tables.not_enough_alone(fixes)
            if alone:
                lines += ["", "Not enough alone:", *(f"  {line}" for line in alone)]
            return lines
        shown = fixes[: analysis.top]
        lines.append(tabulate(tables.fix_rows(shown), headers=tables.FIX_HEADERS))
        lines.extend(f"  {fix.name}: {fix.detail}" for fix in shown if fix.detail)
        first = tables.first_fix_to_apply(fixes)
        if first is not None and first.snippet:
            lines += ["", f"How to apply {first.name}:"]
            lines.extend(f"    {line}" for line in first.snippet.splitlines())
        return lines
