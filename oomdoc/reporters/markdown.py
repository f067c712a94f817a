"""The Markdown report (`oomdoc suggest --format markdown`): for pull
requests and issue threads."""

from __future__ import annotations

from tabulate import tabulate

from oomdoc.analysis import Analysis
from oomdoc.formatting import format_location, printable
from oomdoc.reporters import tables
from oomdoc.reporters.ranks import rank_section_lines


class MarkdownReporter:
    format = "markdown"
    renders = "snapshot"
    summary = "for pull requests and issues"

    def __init__(self, analysis: Analysis):
        self.analysis = analysis

    @classmethod
    def from_analysis(
        cls, analysis: Analysis, snapshot_path: str | None = None
    ) -> MarkdownReporter:
        return cls(analysis)

    def render(self) -> str:
        analysis = self.analysis
        snapshot = analysis.snapshot
        lines = [f"**oomdoc:** {analysis.headline}", ""]
        if snapshot.is_oom and snapshot.oom and snapshot.oom.location:
            lines += [f"at `{format_location(snapshot.oom.location, snapshot.cwd)}`", ""]
        prescription = tables.prescription_lines(analysis)
        if prescription:
            lines += [f"### {prescription[0]}", *(f"- {line.strip()}" for line in prescription[1:])]
            snippet = snapshot.prescription.snippet if snapshot.prescription else None
            if snippet:
                lines += ["", "```python", snippet, "```"]
            lines.append("")
        lines.append(f"### {tables.breakdown_title(snapshot)}")
        lines.append(
            tabulate(
                tables.breakdown_rows(snapshot), headers=tables.BREAKDOWN_HEADERS, tablefmt="github"
            )
        )
        if snapshot.ranks:
            ranks = rank_section_lines(snapshot)
            lines += ["", "```", *[line for line in ranks if line], "```"]
        module_headers, module_rows = tables.module_table(snapshot)
        if module_rows:
            lines += ["", f"### Top modules {snapshot.moment_label} (repeated blocks folded)"]
            lines.append(tabulate(module_rows, headers=module_headers, tablefmt="github"))
        headers, sites = tables.site_table(snapshot.top_allocations, snapshot.cwd, analysis.top)
        if sites:
            lines += ["", "### Top allocation sites"]
            lines.append(tabulate(sites, headers=headers, tablefmt="github"))
        trace = tables.trace_rows(snapshot)
        if trace:
            lines += ["", "### Allocator events before the OOM"]
            lines.append(tabulate(trace, headers=tables.TRACE_HEADERS, tablefmt="github"))
        if analysis.diagnoses:
            lines += ["", "### Diagnosis"]
            for number, item in enumerate(analysis.diagnoses, 1):
                lines.append(f"{number}. **{item.kind}**: {item.summary}")
                lines.extend(f"   - {line}" for line in item.evidence)
                if item.remedy:
                    lines += [
                        "",
                        "   ```python",
                        *[f"   {code}" for code in item.remedy.splitlines()],
                        "   ```",
                    ]
        lines.extend(self._fix_lines())
        lines.extend(f"\n> {note}" for note in analysis.notes)
        return printable("\n".join(lines) + "\n")

    def _fix_lines(self) -> list[str]:
        analysis = self.analysis
        fixes = analysis.shown_fixes
        if not fixes:
            return []
        lines = ["", f"### {tables.fixes_title(analysis.fixes_measured)}"]
        lines.extend(f"> {note}\n" for note in tables.bug_first_notes(analysis))
        if analysis.fixes_measured:
            lines.append(
                tabulate(
                    tables.measured_fix_rows(analysis),
                    headers=tables.MEASURED_FIX_HEADERS,
                    tablefmt="github",
                    colalign=tables.MEASURED_FIX_ALIGN,
                )
            )
            lines.extend(tables.replay_summary_lines(analysis))
            for rank, fix in tables.ranked_fitting(fixes):
                lines += ["", f"**{rank}. {fix.name}: {fix.detail or fix.title or ''}**"]
                if fix.snippet:
                    lines += ["```python", fix.snippet, "```"]
            alone = tables.not_enough_alone(fixes)
            if alone:
                lines += ["", "**Not enough alone:**", *(f"- {line}" for line in alone)]
            return lines
        lines.append(
            tabulate(
                tables.fix_rows(fixes[: analysis.top]),
                headers=tables.FIX_HEADERS,
                tablefmt="github",
            )
        )
        first = tables.first_fix_to_apply(fixes)
        if first is not None and first.snippet:
            lines += ["", f"How to apply {first.name}:", "", "```python", first.snippet, "```"]
        return lines
