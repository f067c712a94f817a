"""Reporters: one class per output format, each built `from_analysis()` and
`render()`ed to a string; `REPORTERS` registers them, one line each.
`oomdoc run`, `oomdoc suggest` and `oomdoc check` pick theirs by format name.

A reporter says what it renders (`renders`: "snapshot", an Analysis, or
"check", a CheckResult) and, in a few words, what it gives (`summary`):
`oomdoc suggest --format` offers every "snapshot" format, from here.

Adding a format: a new module with a reporter class and one line here.
"""

from __future__ import annotations

from typing import Any

from oomdoc.reporters.check_reports import CheckTextReporter, GithubSummaryReporter, JunitReporter
from oomdoc.reporters.html import HtmlReporter
from oomdoc.reporters.json_report import JsonReporter
from oomdoc.reporters.markdown import MarkdownReporter
from oomdoc.reporters.text import TextReporter

REPORTERS: dict[str, Any] = {
    "table": TextReporter,
    "json": JsonReporter,
    "markdown": MarkdownReporter,
    "html": HtmlReporter,
    # oomdoc check renders a CheckResult:
    "check-text": CheckTextReporter,
    "github-summary": GithubSummaryReporter,
    "junit": JunitReporter,
}


def formats_rendering(subject: str) -> list[str]:
    """The format names of the reporters that render `subject` ("snapshot"
    or "check"), in registration order."""
    return [name for name, reporter in REPORTERS.items() if reporter.renders == subject]


def render(output_format: str, analysis: Any, **options: Any) -> str:
    """The report of `analysis` in `output_format` (a key of REPORTERS)."""
    return REPORTERS[output_format].from_analysis(analysis, **options).render()


def write_and_report(snapshot: Any, path: Any, html_path: str | None, stream: Any) -> None:
    """The end of `oomdoc run` (one process or a whole job): write the
    snapshot, then the report on `stream` (and the HTML page when asked)."""
    from oomdoc.analysis import analyse
    from oomdoc.output_paths import write_new_file
    from oomdoc.snapshot import dumps, validate

    document = snapshot.to_dict()
    validate(document)
    # A name taken while the script ran: the snapshot goes beside it, never lost.
    path = write_new_file(path, dumps(document))
    analysis = analyse(snapshot)
    text = render("table", analysis, snapshot_path=str(path))
    if html_path:
        text += f"HTML report: {write_new_file(html_path, render('html', analysis))}\n"
    print(text, file=stream, end="")
