"""A self-contained HTML report: one file, readable offline, safe with any snapshot.

Two layers, so that what is shown can change without touching the drawing:

`view.build_view(analysis)` reads the typed snapshot and its analysis once
and returns the view, a small JSON-safe dict with every list capped (its
keys are listed in oomdoc/reporters/html/view.py).

`render_html(view)` draws the view (drawing.py: primitives and charts;
summary.py and sections.py: the page's parts): inline CSS and a little inline
JavaScript (report.css and report.js, package data read with
importlib.resources), SVG drawn here, and no network access at view time.
Every snapshot string goes through `html.escape`; the data the script reads is
JSON inside `<script type="application/json">` with `<`, `>`, `&`, U+2028 and
U+2029 escaped, and the script writes text with `textContent` only.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from oomdoc.analysis import Analysis
from oomdoc.reporters.html.drawing import Ids, esc, timeline_html
from oomdoc.reporters.html.sections import (
    breakdown_html,
    diagnoses_html,
    fixes_html,
    modules_html,
    nav_html,
    notes_html,
    ranks_html,
    sites_html,
)
from oomdoc.reporters.html.summary import header_html, prescription_html, stats_html
from oomdoc.reporters.html.view import MAX_SITES, MAX_TIMELINE_POINTS, build_view, downsample

__all__ = [
    "MAX_SITES",
    "MAX_TIMELINE_POINTS",
    "HtmlReporter",
    "build_view",
    "downsample",
    "render_html",
    "render_html_report",
]


@cache
def asset(name: str) -> str:
    """The text of a file shipped in this package (report.css, report.js)."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render_html(view: dict) -> str:
    """One self-contained HTML page for a view from `build_view`."""
    ids = Ids()
    body = "".join(
        [
            header_html(view),
            nav_html(view),
            stats_html(view),
            prescription_html(view, ids),
            timeline_html(view),
            breakdown_html(view),
            ranks_html(view),
            diagnoses_html(view, ids),
            modules_html(view),
            sites_html(view),
            fixes_html(view, ids),
            notes_html(view),
        ]
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{esc(view.get('title') or 'oomdoc')}</title>"
        f"<style>\n{asset('report.css')}</style></head>"
        f'<body><main class="page">{body}'
        "<footer>Written by oomdoc. This file is self-contained: it loads nothing from the network.</footer>"
        f"</main><script>\n{asset('report.js')}</script></body></html>\n"
    )


def render_html_report(document: dict, top: int = 10) -> str:
    """The HTML report of a snapshot document, analysed as `oomdoc suggest` does."""
    from oomdoc.analysis import analyse
    from oomdoc.model import Snapshot

    return HtmlReporter.from_analysis(analyse(Snapshot.from_dict(document), top=top)).render()


class HtmlReporter:
    """One self-contained HTML page (`--format html`, `run --html`,
    `check --html`), drawn from the typed snapshot and its analysis."""

    format = "html"
    renders = "snapshot"
    summary = "one self-contained page"

    def __init__(self, analysis: Analysis):
        self.analysis = analysis

    @classmethod
    def from_analysis(cls, analysis: Analysis, snapshot_path: str | None = None) -> HtmlReporter:
        return cls(analysis)

    def render(self) -> str:
        return render_html(build_view(self.analysis))
