"""The package's typed API, called the way the older dict-based tests call
it: documents in, JSON-shaped dicts out. Only tests use this; oomdoc itself
parses a snapshot once, at the boundary (oomdoc.model)."""

from __future__ import annotations

from oomdoc import analysis as _analysis
from oomdoc import check as _check
from oomdoc import diagnosis as _diagnosis
from oomdoc import estimates as _estimates
from oomdoc.check_records import Baseline
from oomdoc.fixes import fix_named
from oomdoc.fixes.optimizer import sharding_estimate as _sharding_estimate
from oomdoc.fixes.ranking import rank_fixes as _rank_fixes
from oomdoc.model import Breakdown, FixResult, Site, Snapshot, parse, to_dict
from oomdoc.replay import plan as _plan
from oomdoc.replay.rank import best_pair as _best_pair
from oomdoc.reporters import render


def snapshot_of(document) -> Snapshot:
    return document if isinstance(document, Snapshot) else Snapshot.from_dict(document)


def diagnose(document) -> list[dict]:
    return [d.as_dict() for d in _diagnosis.diagnose(snapshot_of(document))]


def estimate_fixes(document) -> list[dict]:
    return to_dict(_estimates.estimate_fixes(snapshot_of(document)))


def fixes_for(document) -> tuple[list[dict], bool]:
    fixes, measured = _analysis.fixes_for(snapshot_of(document))
    return to_dict(fixes), measured


def analysis(document, top: int = 5, source_format: str = "oomdoc", path=None) -> dict:
    result = _analysis.analyse(
        snapshot_of(document), top=top, source_format=source_format, path=path
    )
    return render_json(result)


def render_json(result) -> dict:
    import json

    return json.loads(render("json", result))


def render_text(document, snapshot_path=None, top: int = 5) -> str:
    return render(
        "table", _analysis.analyse(snapshot_of(document), top=top), snapshot_path=snapshot_path
    )


def render_markdown(document, top: int = 5) -> str:
    return render("markdown", _analysis.analyse(snapshot_of(document), top=top))


def rank_fixes(fixes: list[dict]) -> list[dict]:
    return to_dict(_rank_fixes([parse(FixResult, fix) for fix in fixes]))


def best_pair(fixes: list[dict]):
    return _best_pair([parse(FixResult, fix) for fix in fixes])


def not_applied(name: str, applied: dict):
    fix = fix_named(name)
    assert fix is not None
    return fix.not_applied(applied)


def plan(document, requested):
    chosen, skipped = _plan.plan(snapshot_of(document), requested)
    return chosen, to_dict(skipped)


def sharding_estimate(static: dict) -> dict:
    return _sharding_estimate(Breakdown(**static))


class check:  # noqa: N801 (stands in for the module in the tests)
    CheckOptions = _check.CheckOptions
    read_baseline = staticmethod(_check.read_baseline)
    run_check = staticmethod(_check.run_check)

    @staticmethod
    def measurement(document, steps: int) -> dict:
        return _check.measurement(snapshot_of(document), steps).to_document()

    @staticmethod
    def baseline_text(baseline: dict) -> str:
        return Baseline.from_document(baseline).text()

    @staticmethod
    def site_changes(baseline_sites: list[dict], current_sites: list[dict]):
        return _check.site_changes(
            [parse(Site, site) for site in baseline_sites],
            [parse(Site, site) for site in current_sites],
        )

    @staticmethod
    def evaluate(document, baseline: dict | None, options, wall_s: float = 0.0):
        typed = Baseline.from_document(baseline) if baseline is not None else None
        return _check.evaluate(snapshot_of(document), typed, options, wall_s)

    @staticmethod
    def render_text(result, options) -> str:
        result.options = options
        return render("check-text", result)

    @staticmethod
    def render_markdown(result, options) -> str:
        result.options = options
        return render("github-summary", result)

    @staticmethod
    def junit_xml(result, options) -> str:
        result.options = options
        return render("junit", result)


def observe(capture, batch_size: int):
    from oomdoc.replay import batch

    return batch.observe(snapshot_of(capture), batch_size)


def median_step_seconds(steps: list[dict]):
    from oomdoc.model import Step
    from oomdoc.replay.timing import step_timing

    timing = step_timing([parse(Step, step) for step in steps])
    return timing.step_s if timing is not None else None
